"""Decorator registries from recipe configs to the code that runs them.

A technique registers its pydantic config class under the name recipes use, and
the function that runs it under that config class:

    @register_stage("rtn")
    class RTNConfig(WeightQuantConfig): ...

    @stage_handler(RTNConfig)
    def run_rtn(model, config, ctx) -> dict: ...

Evals (``register_eval`` / ``eval_handler``) and export formats
(``register_exporter``) work the same way.

Which module defines each name is written down here (``STAGE_MODULES``,
``EVAL_MODULES``, ``EXPORT_MODULES``, ``READER_MODULES``), and a module is imported
only when its name is used (:func:`stage_config`, :func:`eval_config`,
:func:`exporter`, :func:`load_format`): validating a recipe imports the methods it
names and no other, and listing the known names imports nothing. Add a new
technique, eval or format to these tables.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from pydantic import BaseModel, ConfigDict

from lmpress.data import Text
from lmpress.progress import QUIET, Bars

T = TypeVar("T")


class StrictConfig(BaseModel):
    """Base of every recipe section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StageConfig(StrictConfig):
    """Base of one recipe stage; ``method`` names the registered technique."""

    method: str
    # trains the model with every launched process (DDP); the other stages run in each process alone
    trains_across_processes: ClassVar[bool] = False
    # streams the model through the layer-wise calibration engine (its memory: lmpress.memory_plan)
    calibrates_layerwise: ClassVar[bool] = False

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
    "llm_int8": "lmpress.quantize.bnb",
    "bnb_4bit": "lmpress.quantize.bnb",
    "magnitude": "lmpress.prune.magnitude",
    "wanda": "lmpress.prune.wanda",
    "sparsegpt": "lmpress.prune.sparsegpt",
    "structured": "lmpress.prune.structured",
    "distill": "lmpress.distill.stage",
}
EVAL_MODULES: dict[str, str] = {
    "perplexity": "lmpress.evals.perplexity",
    "passkey": "lmpress.evals.longctx",
    "ppl_by_position": "lmpress.evals.longctx",
    "lmeval": "lmpress.evals.lmeval",
}
EXPORT_MODULES: dict[str, str] = {
    "hf": "lmpress.export.hf",
    "gptq": "lmpress.export.gptq",
    "awq": "lmpress.export.awq",
    "compressed-tensors": "lmpress.export.compressed_tensors",
    "gguf": "lmpress.export.gguf",
    "onnx": "lmpress.export.onnx",
    "bitsandbytes": "lmpress.export.bnb",
}
# an export directory's single model file (no config.json) -> the module whose loader reads it
ARTIFACT_FILE_MODULES: dict[str, str] = {"model.gguf": "lmpress.export.gguf", "model.onnx": "lmpress.export.onnx"}
# a checkpoint's quantization_config.quant_method -> the module whose reader loads it
READER_MODULES: dict[str, str] = {
    "gptq": "lmpress.export.gptq",
    "awq": "lmpress.export.awq",
    "compressed-tensors": "lmpress.export.compressed_tensors",
}

STAGE_CONFIGS: dict[str, type[StageConfig]] = {}
STAGE_HANDLERS: dict[type[StageConfig], Callable[..., dict]] = {}
EVAL_CONFIGS: dict[str, type[EvalConfig]] = {}
EVAL_HANDLERS: dict[type[EvalConfig], Callable[..., Any]] = {}
EXPORTERS: dict[str, Callable[..., None]] = {}


def _register(table: dict[str, Any], kind: str, name: str) -> Callable[[T], T]:
    def decorator(obj: T) -> T:
        if name in table and table[name] is not obj:
            raise RuntimeError(f"{kind} {name!r} is registered twice")
        table[name] = obj
        return obj

    return decorator


def known_stages() -> list[str]:
    return sorted(set(STAGE_MODULES) | set(STAGE_CONFIGS))


def known_evals() -> list[str]:
    return sorted(set(EVAL_MODULES) | set(EVAL_CONFIGS))


def known_exporters() -> list[str]:
    return sorted(set(EXPORT_MODULES) | set(EXPORTERS))


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


def exporter(fmt: str) -> Callable[..., None]:
    """The writer of export format ``fmt`` (KeyError when unknown)."""
    return _lookup(EXPORTERS, EXPORT_MODULES, fmt)


def load_format(fmt: str) -> None:
    """Import export format ``fmt``'s module, so its plan and scheme checks are registered."""
    if fmt in EXPORT_MODULES:
        importlib.import_module(EXPORT_MODULES[fmt])


def load_reader(quant_method: str) -> bool:
    """Import the module that reads checkpoints of ``quant_method``; False when lmpress has none."""
    if quant_method not in READER_MODULES:
        return False
    importlib.import_module(READER_MODULES[quant_method])
    return True


def calibration_method(method: str, config: StageConfig) -> Any:
    """Method ``method`` as one step of another stage's calibration pass (GPTQ rounding inside AWQ or
    SparseGPT), built from ``config``: composing methods by name keeps one method's module from importing
    another's."""
    module = importlib.import_module(STAGE_MODULES[method])
    return module.calibration_method(config)


def register_stage(method: str) -> Callable[[type[StageConfig]], type[StageConfig]]:
    return _register(STAGE_CONFIGS, "stage method", method)


def stage_handler(config_cls: type[StageConfig]) -> Callable[[Callable], Callable]:
    def decorator(fn: Callable) -> Callable:
        STAGE_HANDLERS[config_cls] = fn
        return fn

    return decorator


def register_eval(name: str) -> Callable[[type[EvalConfig]], type[EvalConfig]]:
    return _register(EVAL_CONFIGS, "eval", name)


def eval_handler(config_cls: type[EvalConfig]) -> Callable[[Callable], Callable]:
    def decorator(fn: Callable) -> Callable:
        EVAL_HANDLERS[config_cls] = fn
        return fn

    return decorator


def register_exporter(fmt: str) -> Callable[[Callable], Callable]:
    return _register(EXPORTERS, "export format", fmt)


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
