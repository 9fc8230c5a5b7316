"""Registries from recipe names to the code that runs them, one registration each.

A technique registers its handler under the name recipes use, with its pydantic config class:

    class RTNConfig(WeightQuantConfig): ...

    @register_stage("rtn", RTNConfig)
    def run_rtn(model, config, ctx) -> dict: ...

An eval registers the same way (``register_eval``). An export format registers one
``ExportFormat`` (its writer, what it refuses, how it reads back) with ``register_format``.

Which module registers each name is written down here, one line each (``STAGE_MODULES``,
``EVAL_MODULES``, ``FORMAT_MODULES``), and a module is imported only when its name is
used: validating a recipe imports the methods it names and no other, and listing the
known names imports nothing. A new technique, eval or format is its module plus its line.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict

from lmpress.cache import apply_umask_modes
from lmpress.data import Text
from lmpress.progress import QUIET, Bars

T = TypeVar("T")


class StrictConfig(BaseModel):
    """Base of every recipe section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _valid_patterns(patterns: T) -> T:
    """``patterns`` (a list, or a dict keyed by pattern) when each is a regular expression; ValueError naming the
    first that is not."""
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{pattern!r} is not a valid regular expression ({e})") from e
    return patterns


# Layer-name regular expressions (a stage's ``ignore``; the keys of its ``overrides``), checked when read.
LayerPatterns = Annotated[list[str], AfterValidator(_valid_patterns)]
PatternKeyed = Annotated[dict[str, T], AfterValidator(_valid_patterns)]


class StageConfig(StrictConfig):
    """Base of one recipe stage; ``method`` names the registered technique."""

    method: str
    # trains the model with every launched process (DDP); the other stages run in each process alone
    trains_across_processes: ClassVar[bool] = False
    # streams the model through the layer-wise calibration engine (its memory: lmpress.memory_plan); such a
    # stage has a batch_size field (calibration samples per forward pass)
    calibrates_layerwise: ClassVar[bool] = False
    # its layer-wise pass shares the calibration batches out across launched processes, each holding its share's
    # activations (every method of the pass reduces what it gathers: lmpress.calib.ranks)
    spreads_across_processes: ClassVar[bool] = False
    # a spread pass shares each batch's samples out instead of whole batches (it steps one batch at a time)
    shares_batch_rows: ClassVar[bool] = False
    # holds the whole model at once (rotate rewrites every weight; the draft head runs the model): nothing streams
    reads_whole_model: ClassVar[bool] = False
    # the memory forecast's name for what learning_bytes counts
    learning_label: ClassVar[str] = "learning"
    # removes layers, heads or channels: the forecast plans the later stages on the skeleton reshape_skeleton leaves
    reshapes_model: ClassVar[bool] = False

    @property
    def unties_tied_head(self) -> bool:
        """Whether it gives a head tied to the embedding weights of its own (the memory forecast counts a table
        more in the candidate and in dense exports)."""
        return False

    @property
    def hessian_copies(self) -> int:
        """n x n float32 matrices a layer-wise stage holds per linear at its solve (the memory forecast)."""
        return 2

    @property
    def gathers_hessians(self) -> bool:
        """Whether its layer-wise pass holds a Hessian per linear (GPTQ, SparseGPT): the memory forecast counts
        the per-expert Hessians of a MoE layer, held at once."""
        return False

    def quantized_linears(self, model: Any) -> dict[str, tuple[Any, Any]]:
        """The ``nn.Linear`` layers of ``model`` this stage replaces by quantized ones, each with its
        ``QuantScheme``: what the export checks (before any work) and the memory forecast plan for."""
        return {}

    def reshape_skeleton(self, model: Any) -> None:
        """Make on ``model``, a skeleton on the meta device, the structural change this stage makes
        (``reshapes_model``): the shapes only, as which layers or channels go is the calibration data's call."""

    def learning_bytes(self, shape: Any, seq_len: int, packed: int = 0) -> int:
        """Bytes a whole-model stage holds beside the weights while it learns (the memory forecast; ``shape``:
        ``lmpress.memory_plan.ModelShape``, ``packed``: the bytes of the packed weights the stages make)."""
        return 0

    def training_bytes(
        self, shape: Any, teacher: Any, size: int, quantized: tuple[int, int], seq_len: int, processes: int
    ) -> int:
        """Bytes a training stage (``trains_across_processes``) holds beside the student's weights, in each of
        ``processes``: ``shape`` is the student as the stages before leave it, ``teacher`` the model as loaded
        (``lmpress.memory_plan.ModelShape``), ``quantized`` the weights and scale groups of the quantized layers it
        trains (those the stages before it quantized)."""
        return 0

    def check(self, model: Any) -> None:
        """Raise LmpressInputError when this stage cannot run on ``model`` (before any work)."""

    def check_processes(self, world: int) -> None:
        """Raise LmpressInputError when this stage cannot run across ``world`` launched processes."""

    def texts(self) -> list[str]:
        """Text sources this stage reads besides the recipe's calibration data (checked before any work)."""
        return []

    def training_texts(self, data_source: str) -> list[str]:
        """Text sources this stage trains on (``data_source``: the recipe's); never the eval text."""
        return []


class EvalConfig(StrictConfig):
    """Base of one eval in a recipe's ``eval:`` section."""

    # Metrics that exist only for a candidate (e.g. KLD against the baseline): gates use them
    # as they are; every other metric also gets NAME_delta and NAME_ratio (candidate vs baseline).
    candidate_only: ClassVar[frozenset[str]] = frozenset()

    def metric_names(self) -> list[str]:
        """Every metric this eval reports (the keys of its EvalResult.metrics)."""
        raise NotImplementedError

    def check(self, model: Any) -> None:
        """Raise LmpressInputError when this eval cannot run on ``model`` (before any work)."""

    def logit_tokens(self) -> int:
        """Tokens whose logits one forward of this eval holds at once (the memory forecast); 0 when unknown."""
        return 0


# name -> the module that registers it (imported on first use)
STAGE_MODULES: dict[str, str] = {
    "rtn": "lmpress.quantize.rtn",
    "gptq": "lmpress.quantize.gptq",
    "awq": "lmpress.quantize.awq",
    "learned": "lmpress.quantize.learned_rounding",
    "smoothquant": "lmpress.quantize.smoothquant",
    "fp8": "lmpress.quantize.fp8",
    "rotate": "lmpress.quantize.rotate",
    "llm_int8": "lmpress.quantize.bnb",
    "bnb_4bit": "lmpress.quantize.bnb",
    "magnitude": "lmpress.prune.magnitude",
    "wanda": "lmpress.prune.wanda",
    "sparsegpt": "lmpress.prune.sparsegpt",
    "structured": "lmpress.prune.structured",
    "distill": "lmpress.distill.stage",
    "draft_head": "lmpress.distill.draft_head_stage",
}
EVAL_MODULES: dict[str, str] = {
    "perplexity": "lmpress.evals.perplexity",
    "passkey": "lmpress.evals.longctx",
    "ppl_by_position": "lmpress.evals.longctx",
    "lmeval": "lmpress.evals.lmeval",
    "speculation": "lmpress.evals.speculation",
}
FORMAT_MODULES: dict[str, str] = {
    "hf": "lmpress.export.hf",
    "gptq": "lmpress.export.gptq",
    "awq": "lmpress.export.awq",
    "compressed-tensors": "lmpress.export.compressed_tensors",
    "gguf": "lmpress.export.gguf",
    "onnx": "lmpress.export.onnx",
    "bitsandbytes": "lmpress.export.bnb",
}


@dataclass(frozen=True)
class ExportFormat:
    """One export format: how lmpress writes it, what it cannot hold, and how lmpress reads it back."""

    name: str
    write: Callable[[Any, Any, Path], None]  # (model, tokenizer, out_dir)
    # (QuantScheme, act_order) -> why the format cannot hold a layer of that scheme, or None; from the recipe alone
    refuse_scheme: Callable[[Any, bool], str | None] | None = None
    # (model, {layer: PlannedLayer}) -> raises LmpressInputError for what the format cannot hold, before any work
    check_plan: Callable[[Any, dict[str, Any]], Any] | None = None
    # (config, tensors) -> {layer: QuantizedWeight}, for checkpoints whose quantization_config.quant_method is ``name``
    read: Callable[[dict[str, Any], dict[str, torch.Tensor]], dict[str, Any]] | None = None
    packed_suffixes: tuple[str, ...] = ()  # the tensor names that hold a read layer's weight (all but bias)
    # a single-file export (no config.json beside it) and its loader (directory, dtype) -> model
    artifact_file: str | None = None
    load_artifact: Callable[[Path, torch.dtype], Any] | None = None
    # (directory) -> (model config values, {module: quantized weight, or tensor name: float tensor}) of such an
    # export, which lmpress's runtime builds its model from without a transformers model
    read_tensors: Callable[[Path], tuple[dict[str, Any], dict[str, Any]]] | None = None


STAGE_CONFIGS: dict[str, type[StageConfig]] = {}
STAGE_HANDLERS: dict[type[StageConfig], Callable[..., dict]] = {}
EVAL_CONFIGS: dict[str, type[EvalConfig]] = {}
EVAL_HANDLERS: dict[type[EvalConfig], Callable[..., Any]] = {}
FORMATS: dict[str, ExportFormat] = {}


def _register(table: dict[str, Any], kind: str, name: str, obj: Any) -> None:
    if name in table and table[name] is not obj:
        raise RuntimeError(f"{kind} {name!r} is registered twice")
    table[name] = obj


def register_stage(method: str, config_cls: type[StageConfig]) -> Callable[[Callable], Callable]:
    """Register the decorated function as the handler of stage ``method``, configured by ``config_cls``."""

    def decorator(fn: Callable) -> Callable:
        _register(STAGE_CONFIGS, "stage method", method, config_cls)
        STAGE_HANDLERS[config_cls] = fn
        return fn

    return decorator


def register_eval(name: str, config_cls: type[EvalConfig]) -> Callable[[Callable], Callable]:
    """Register the decorated function as the handler of eval ``name``, configured by ``config_cls``."""

    def decorator(fn: Callable) -> Callable:
        _register(EVAL_CONFIGS, "eval", name, config_cls)
        EVAL_HANDLERS[config_cls] = fn
        return fn

    return decorator


def register_format(fmt: ExportFormat) -> ExportFormat:
    _register(FORMATS, "export format", fmt.name, fmt)
    return fmt


def known_stages() -> list[str]:
    return sorted(set(STAGE_MODULES) | set(STAGE_CONFIGS))


def known_evals() -> list[str]:
    return sorted(set(EVAL_MODULES) | set(EVAL_CONFIGS))


def known_exporters() -> list[str]:
    return sorted(set(FORMAT_MODULES) | set(FORMATS))


def _lookup(table: dict[str, Any], modules: dict[str, str], name: str) -> Any:
    """``table[name]``, importing the module that registers ``name`` first; KeyError when no module does."""
    if name not in table and name in modules:
        importlib.import_module(modules[name])
    return table[name]


def stage_config(method: str) -> type[StageConfig]:
    """The config class of stage method ``method`` (KeyError when unknown)."""
    return _lookup(STAGE_CONFIGS, STAGE_MODULES, method)


def stage_handler_for(config: StageConfig) -> Callable[..., dict]:
    return STAGE_HANDLERS[type(config)]


def eval_config(name: str) -> type[EvalConfig]:
    """The config class of eval ``name`` (KeyError when unknown)."""
    return _lookup(EVAL_CONFIGS, EVAL_MODULES, name)


def export_format(name: str) -> ExportFormat:
    """Export format ``name`` (KeyError when unknown)."""
    return _lookup(FORMATS, FORMAT_MODULES, name)


# Checks every writer runs first, ``check(model, fmt)`` raising LmpressInputError: units above this one register
# theirs where they define what a format may not hold (online_rotation.py: a rotated input).
EXPORT_CHECKS: list[Callable[[Any, str], None]] = []


def register_export_check(check: Callable[[Any, str], None]) -> Callable[[Any, str], None]:
    EXPORT_CHECKS.append(check)
    return check


def exporter(fmt: str) -> Callable[..., None]:
    """The writer of export format ``fmt`` (KeyError when unknown); what it writes gets the umask's modes."""
    write = export_format(fmt).write

    @functools.wraps(write)
    def write_with_modes(model: Any, tokenizer: Any, out_dir: Path, *args: Any, **kwargs: Any) -> None:
        for check in EXPORT_CHECKS:  # refusals that hold for every writer: nothing is written
            check(model, fmt)
        write(model, tokenizer, out_dir, *args, **kwargs)
        apply_umask_modes(out_dir)

    return write_with_modes


def reading_format(quant_method: str) -> ExportFormat | None:
    """The format that reads checkpoints whose quantization_config.quant_method is ``quant_method``, or None."""
    try:
        fmt = export_format(quant_method)
    except KeyError:
        return None
    return fmt if fmt.read is not None else None


def readable_methods() -> list[str]:
    """Every quant_method lmpress reads (imports every format's module: for error messages)."""
    return sorted(name for name in FORMAT_MODULES if reading_format(name))


def artifact_format(directory: Path) -> ExportFormat | None:
    """The single-file format whose file ``directory`` holds (model.gguf, model.onnx), or None."""
    for name in FORMAT_MODULES:
        fmt = export_format(name)
        if fmt.artifact_file is not None and (Path(directory) / fmt.artifact_file).is_file():
            return fmt
    return None


def calibration_method(method: str, config: StageConfig) -> Any:
    """Method ``method`` as one step of another stage's calibration pass (GPTQ rounding inside AWQ or
    SparseGPT), built from ``config``: composing methods by name keeps one method's module from importing
    another's."""
    module = importlib.import_module(STAGE_MODULES[method])
    return module.calibration_method(config)


@dataclass
class StageContext:
    """What the pipeline hands a stage besides the model and its config."""

    calibration: Callable[[], torch.Tensor]  # (n_samples, seq_len) token ids, computed on first call
    state_dir: Path  # private to this stage; survives an interrupted run for --resume
    resume: bool
    fingerprint: str  # model + calibration data + this stage's config: resume refuses when it changed
    bars: Bars = QUIET
    device: torch.device = torch.device("cpu")
    tokenizer: Any = None
    text_source: str | None = None  # the recipe's calibration text (data.source)
    # loads the unmodified model again (None) or another model source, for stages that learn from it
    teacher: Callable[[str | None], Any] | None = None
    # the main process's state_dir for this stage: where launched processes keep what they share (a training
    # checkpoint); None means state_dir
    shared_state_dir: Path | None = None
    # calibration activations beyond this many bytes go to memory-mapped files in spill_dir (None: all in RAM;
    # spill_dir None: the stage's state directory)
    activations_ram_bytes: int | None = None
    spill_dir: Path | None = None


@dataclass
class EvalContext:
    """What the pipeline hands an eval: the eval text and where baseline artifacts live."""

    text: Text
    ids: Callable[[], torch.Tensor]  # the eval text as one 1-D token stream
    role: str  # "baseline" or "candidate"
    store: Path  # the baseline's artifact directory: written by the baseline, read by candidates
    bars: Bars = QUIET
    device: torch.device = torch.device("cpu")


@dataclass
class EvalResult:
    metrics: dict[str, float]  # flat numbers that gates and tables use
    details: dict[str, Any] = field(default_factory=dict)  # tables/series for reports and plots
    protocol: dict[str, Any] = field(default_factory=dict)  # everything needed to reproduce the numbers
