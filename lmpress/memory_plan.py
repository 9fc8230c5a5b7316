"""What a run will need in memory, forecast from the model's config and the recipe before any weight is read.

Each phase of a run gets its own forecast, the parts it holds at once; the run's is the largest phase's. The
phases are those a run reports measured (report.json "phases", the stages' peaks under "stages"): the stages,
the baseline eval, the read-back of the exports, the runtime agreement check and the candidate eval. The stages
hold what stays resident for the whole run and the largest working set of one stage:

- ``process``: Python, torch, transformers and lmpress, and the allocator's arenas (measured, a constant);
- ``weights``: the float model (and the head's own table where a rotation unties it from the embedding). A
  safetensors checkpoint read in the dtype it is stored in is memory-mapped: a run that only streams layers
  (one-shot stages, no eval, no training) keeps about one decoder layer of it resident at a time (the engine
  drops a finished layer's pages); anything that reads the whole model (an eval, a training stage) holds all of
  it. A MoE checkpoint's experts are mapped too where stored one tensor each (the
  usual layout; ``expert_checkpoint``);
- ``float weights until quantized``: where the weights were copied in at load (another dtype than stored, a MoE
  checkpoint storing its experts stacked, as gpt-oss's does), the quantized linears' float weights, all held
  when the stages begin;
- ``mapped float pages``: where the checkpoint is mapped and read whole, the pages of the quantized linears'
  float weights, which stay resident beside their codes to the end of the run (the mapping lives as long as any
  tensor of it does);
- ``quantized``: the packed codes, scales and zero points of every linear a quantization stage replaces; where
  the layers stream through the layer-wise engine, only the largest layer's (the engine reads each finished
  layer's back from its state file, memory-mapped);
- the stages' largest working set: ``calibration`` (the engine's float16 activation slab of samples x seq_len x
  hidden, one forward's float32 temporaries, and the largest linear's statistics and GPTQ/SparseGPT working
  copies: its Hessian, the damped inverse's factor and float32 copies of the weight) or ``training`` (student
  weights, gradients and the optimizer's two moments in float32, plus a teacher in the run's dtype).

An eval holds the model and ``eval``: a batch's float32 logits and one window's log-softmax; a 16-bit model on a
CPU without that dtype's matrix unit also one decoder layer or the output layer in float32 (``float32 layer``: the
evals and the read-back and agreement checks compute so, calib.compute_dtype). After the stages
the run holds the candidate (its float parts and packed codes): the read-back loads each
export beside it (a dense format is the float model again); the runtime agreement builds lmpress's runtime from
the first export beside both (its FP4 W4A4 layers as float weights, dequantized once) and compares both sides'
float32 logits over the first eval window; the candidate
eval scores the read-back export alone (the in-memory candidate is dropped first) with the eval's logits.

On a CUDA device the one-shot engine keeps one layer, its statistics and one batch's activations there; the
slab stays in RAM. The figures are checked against measured peaks by ``bench/scale.py`` (docs/scale.md) and by
each run's report (its forecast per phase beside the measured peak).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmpress.anatomy import decoder_layers, get_anatomy, layer_linears
from lmpress.calib.compute_dtype import widens_to_float32
from lmpress.calib.moe import expert_of, is_experts_block_name
from lmpress.errors import LmpressInputError
from lmpress.expert_checkpoint import experts_stream
from lmpress.metrics import NLL_CHUNK
from lmpress.runtime.kernels.cpu_int import w4_fits
from lmpress.weights.float8 import real_fp8_matmul_available
from lmpress.weights.scheme import QuantScheme

if TYPE_CHECKING:
    from lmpress.recipe import Recipe

GIB = 1 << 30
# Measured: RSS after importing torch, transformers and lmpress and loading a model from its mapped files (its
# modules, the tokenizer, the calibration text), before any weight is read: 484 MB for Llama-3.2-1B's shape.
PROCESS_BYTES = 480 << 20
# One forward of a decoder layer holds about this many float32 tensors of (batch, seq_len, intermediate) alive
# (gate, up, their product, the activation); the allocator keeps their pages after they are freed, so they
# count beside the solve that follows.
FORWARD_TENSORS = 4
# Exports read back as a float model: a dense checkpoint, and GGUF (transformers dequantizes it when loading).
DENSE_FORMATS = ("hf", "gguf")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class MemoryForecast:
    """Bytes by part of each phase; ``ram_bytes`` / ``device_bytes`` are what the run's peak is forecast to be."""

    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    device_parts: dict[str, int] = field(default_factory=dict)
    processes: int = 1  # launched processes: the forecast is each one's

    @property
    def phase(self) -> str:
        """The phase forecast to hold the most."""
        return max(self.phases, key=lambda name: sum(self.phases[name].values()))

    @property
    def parts(self) -> dict[str, int]:
        """The largest phase's parts."""
        return self.phases[self.phase]

    @property
    def ram_bytes(self) -> int:
        return sum(self.parts.values())

    def phase_bytes(self) -> dict[str, int]:
        return {name: sum(parts.values()) for name, parts in self.phases.items()}

    @property
    def device_bytes(self) -> int:
        return sum(self.device_parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{name} {size / GIB:.2f}" for name, size in self.parts.items() if size)
        line = f"memory forecast: {self.ram_bytes / GIB:.2f} GiB RAM at peak ({parts} GiB; largest phase: {self.phase})"
        if self.processes > 1:  # the others stop after the stages (lmpress.distributed)
            stages = sum(self.phases.get("stages", {}).values())
            line += f"; each of the {self.processes - 1} other launched processes {stages / GIB:.2f} GiB"
        if self.device_parts:
            line += f", {self.device_bytes / GIB:.2f} GiB on the GPU"
        return line


@dataclass(frozen=True)
class ModelShape:
    """The sizes the forecast needs, read off a model built on the meta device."""

    parameters: int  # every parameter, embeddings included
    layer_parameters: int  # the largest decoder layer's
    hidden: int
    vocab: int
    linears: tuple[tuple[str, int, int], ...]  # (full name, out_features, in_features) of every decoder linear
    layers: int = 0
    heads: int = 0  # attention's query heads
    kv_width: int = 0  # one layer's keys (as its values) per token: key-value heads x head size

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        layers = decoder_layers(model)
        linears = []
        for index, layer in enumerate(layers):
            for name, linear in layer_linears(layer).items():
                linears.append((f"{index}.{name}", linear.out_features, linear.in_features))
        config = model.config
        heads = getattr(config, "num_attention_heads", 0) or 0
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
        return cls(
            parameters=sum(p.numel() for p in model.parameters()),
            layer_parameters=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
            hidden=config.hidden_size,
            vocab=config.vocab_size,
            linears=tuple(linears),
            layers=len(layers),
            heads=heads,
            kv_width=(getattr(config, "num_key_value_heads", None) or heads) * head_dim,
        )

    @property
    def layer_expert_parameters(self) -> int:
        """The most parameters one decoder layer's MoE experts hold (0 without experts)."""
        by_layer: dict[str, int] = {}
        for name, rows, cols in self.linears:
            layer, _, rest = name.partition(".")
            parsed = expert_of(rest)
            if parsed is not None and is_experts_block_name(parsed[0]):
                by_layer[layer] = by_layer.get(layer, 0) + rows * cols
        return max(by_layer.values(), default=0)

    @property
    def widest_input(self) -> int:
        return max(i for _, _, i in self.linears)

    @property
    def widest_output(self) -> int:
        return max(o for _, o, _ in self.linears)


def stored_dtype(checkpoint: Path) -> str | None:
    """The dtype the checkpoint's safetensors files hold (from its config), or None when they are not safetensors.
    A directory with a config and no weights (a shape to forecast) stands for the safetensors checkpoint it
    describes."""
    weights = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
    if not any(checkpoint.glob("*.safetensors")) and any(any(checkpoint.glob(p)) for p in weights):
        return None
    config = json.loads((checkpoint / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def packed_bytes(rows: int, cols: int, bits: int, group_size: int, group_bytes: int = 4 + 1) -> int:
    """A quantized linear's buffers: int32 words of codes and ``group_bytes`` per group (``QuantizedLinear``'s: a
    float32 scale and a uint8 zero point; ``scale_bytes`` gives each format's)."""
    groups = rows * (1 if group_size <= 0 else cols // group_size)
    return rows * -(-cols * bits // 32) * 4 + groups * group_bytes


def scale_bytes(scheme: QuantScheme) -> int:
    """Bytes a group of ``scheme`` keeps beside its codes: FP4's one-byte block scale (E4M3 or E8M0), FP8's float32
    scale per row (no zero point), the integer schemes' float32 scale and uint8 zero point."""
    if scheme.fp4:
        return 1
    return 4 if scheme.activations == "fp8" else 4 + 1


def share_of_samples(samples: int, batch_size: int, processes: int, by_rows: bool = False) -> int:
    """The most calibration samples one of ``processes`` holds when they share the batches out (``calib.ranks``;
    ``by_rows``: each batch's samples)."""
    batches = -(-samples // batch_size)
    if by_rows:
        return min(samples, batches * -(-batch_size // processes))
    return min(samples, -(-batches // processes) * batch_size)


def expert_hessian_bytes(shape: ModelShape, processes: int = 1) -> int:
    """The most per-expert Hessians of one MoE layer a process holds at once (its experts' down projections': each
    an n x n float32 matrix, or its float64 sums' upper triangle, as much), a share by expert where ``processes``
    spread them (``calib.expert_ranks``); 0 for a model without experts."""
    by_layer: dict[str, list[int]] = {}
    for name, _, cols in shape.linears:
        layer, _, rest = name.partition(".")
        parsed = expert_of(rest)
        if parsed is not None and parsed[2] == "down_proj" and is_experts_block_name(parsed[0]):
            by_layer.setdefault(layer, []).append(cols)
    return max((-(-len(c) // processes) * max(c) ** 2 * 4 for c in by_layer.values()), default=0)


def calibration_bytes(
    shape: ModelShape,
    samples: int,
    seq_len: int,
    batch_size: int,
    hessian_copies: int = 2,
    activations_ram: int | None = None,
    expert_hessians: int = 0,
) -> int:
    """The one-shot engine's peak beyond weights: slab, one forward's temporaries and the largest linear's work
    (``hessian_copies``: 2 where the Hessian and a working copy are held, 1 where GPTQ factors in the Hessian);
    ``activations_ram``: the slabs' budget of RAM (``data.activations_ram_gb``), beyond which they are files;
    ``expert_hessians``: a MoE layer's per-expert Hessians held beside (``expert_hessian_bytes``)."""
    slab = samples * seq_len * shape.hidden * 2
    if activations_ram is not None:
        slab = min(slab, activations_ram)
    batch_tokens = min(batch_size, samples) * seq_len
    forward = FORWARD_TENSORS * batch_tokens * shape.widest_output * 4
    # GPTQ / SparseGPT on one linear: the accumulated Hessian and its working copy, factored in place
    # (2 x cols^2; 1 x where GPTQ is handed the Hessian), beside float32 copies of the weight's transpose and
    # of the codes being written. Before that, the Hessian's float64 sums (its upper triangle: a float32
    # matrix's bytes) are rounded into the float32 Hessian: 2 x cols^2 for a moment.
    solve = max(
        max(2 * cols * cols, hessian_copies * cols * cols + 2 * rows * cols) * 4 for _, rows, cols in shape.linears
    )
    return slab + forward + solve + expert_hessians


def forecast_memory(
    model: nn.Module,
    checkpoint: Path,
    dtype: str,
    stages: Sequence,
    samples: int,
    seq_len: int,
    device: torch.device,
    logit_tokens: int = 0,
    exports: Sequence[str] = (),
    agreement_tokens: int = 512,
    processes: int = 1,
    activations_ram: int | None = None,
) -> MemoryForecast:
    """The run's peak memory: ``model`` is the checkpoint's skeleton on the meta device (``model_skeleton``),
    ``stages`` the recipe's stage configs, ``logit_tokens`` the tokens of the largest eval forward (0: no eval),
    ``exports`` the formats written and read back, ``agreement_tokens`` the eval's window (the read-back's and
    the runtime agreement check's first window, a perplexity window's log-softmax); with ``processes`` launched,
    each one's (the main process's: the others stop after the stages), where a spread pass holds a share of the
    calibration activations."""
    shape = ModelShape.of(model)  # as loaded: the baseline eval, a distillation's teacher
    final = skeleton_after(model, stages)  # as the stages leave it: the candidate, its exports and evals
    final_shape = ModelShape.of(final) if final is not model else shape
    size = DTYPE_BYTES[dtype]
    training = any(s.trains_across_processes for s in stages)
    whole = any(s.reads_whole_model for s in stages)
    # a checkpoint stored in the run's dtype stays mapped from its files (a MoE one's experts too, where stored
    # one tensor each: expert_checkpoint); the layer-wise engine then reads one layer's weights at a time
    file_backed = stored_dtype(checkpoint) == dtype and experts_stream(checkpoint, model)
    streams = file_backed and not logit_tokens and not training and not whole
    float_model = shape.parameters * size
    plans = linear_plans(final, stages)
    quantizers = list({id(stage): stage for _, _, stage in plans.values()}.values())
    planned = {name: plan for name, (plan, _, _) in plans.items()}
    quantized = sum(packed_bytes(*plan) for plan in planned.values())
    by_layer: dict[str, int] = {}
    for name, plan in planned.items():
        layer = name.removeprefix(f"{get_anatomy(model).layers}.").partition(".")[0]
        by_layer[layer] = by_layer.get(layer, 0) + packed_bytes(*plan)
    # the engine maps finished layers' packed weights from its state files; a whole-model stage (RTN) holds them
    mapped = streams and quantizers and all(s.calibrates_layerwise for s in quantizers)
    replaced = sum(rows * cols for rows, cols, *_ in planned.values()) * size
    # A tied table counted once among the parameters and replaced as the head: the input embedding keeps it float.
    # A stage that unties a float head (R1 folds the final norm into it) adds the head's own table to the model.
    table = shape.vocab * shape.hidden * size
    tied = getattr(model.config, "tie_word_embeddings", False)
    head_quantized = get_anatomy(model).lm_head in planned
    kept_table = table if tied and head_quantized else 0
    float_head = table if tied and not head_quantized and any(s.unties_tied_head for s in stages) else 0

    process = {"process": PROCESS_BYTES}
    # A checkpoint stored in the run's dtype is memory-mapped, and the mapping lives as long as any of its tensors
    # (the embedding, the norms): the pages of the quantized linears' float weights, once read whole (a baseline
    # eval, RTN, a rotation), stay resident beside their codes to the end of the run (the quickstart's phases after
    # its baseline eval measured 500-600 MB over a forecast without them). Only the layer-wise engine's streaming
    # drops a layer's pages once it is quantized. So do the pages of the weights a structural stage removed (within
    # the stages, "weights" below counts them).
    removed = (shape.parameters - final_shape.parameters) * size
    float_pages = {"mapped float pages": replaced} if file_backed and not streams else {}
    pages_after = {"mapped float pages": replaced + removed} if file_backed and not streams else {}
    # a streamed layer's float weights give way to its codes; a model read whole keeps what is not quantized. A
    # 16-bit layer calibrated on a CPU without 16-bit matrix units is held in float32, its checkpoint pages given
    # back meanwhile (calib.compute_dtype; bench/scale.py's 8B layers measured so on an AVX2 EPYC)
    upcast = any(s.calibrates_layerwise for s in stages) and widens_to_float32(getattr(torch, dtype), device)
    # the layer's float weights and, once quantized, their dequantized stand-ins; spread over processes, a MoE
    # expert's stand-ins are held by the process that solved it alone (LayerSession.apply)
    spread = processes if any(s.spreads_across_processes and s.calibrates_layerwise for s in quantizers) else 1
    stand_ins = shape.layer_parameters - shape.layer_expert_parameters * (spread - 1) // spread
    streamed_layer = 4 * shape.layer_parameters if upcast else (shape.layer_parameters + stand_ins) * size
    # weights copied in at load (another dtype; a MoE checkpoint's stacked experts) are all held when the stages
    # begin, each freed once its codes replace it
    copied = {"float weights until quantized": replaced} if not file_backed else {}
    resident = (
        {
            "weights": streamed_layer if streams else float_model - replaced + float_head,
            "quantized": max(by_layer.values(), default=0) if mapped else quantized,
        }
        | float_pages
        | copied
    )

    def recorded_block_inputs(stage: Any) -> int:
        """Spread by expert, a MoE experts block's input on this process's batches, recorded (calib.expert_ranks)."""
        if processes == 1 or not stage.spreads_across_processes or stage.shares_batch_rows:
            return 0
        if not shape.layer_expert_parameters:
            return 0
        share = share_of_samples(samples, stage.batch_size, processes)
        return share * seq_len * shape.hidden * (4 if upcast else size)

    calibration = max(
        (
            calibration_bytes(
                shape,
                share_of_samples(
                    samples, s.batch_size, processes if s.spreads_across_processes else 1, s.shares_batch_rows
                ),
                seq_len,
                s.batch_size,
                s.hessian_copies,
                activations_ram,
                expert_hessian_bytes(shape, processes if s.spreads_across_processes and not s.shares_batch_rows else 1)
                + recorded_block_inputs(s)
                if s.gathers_hessians
                else 0,
            )
            for s in stages
            if s.calibrates_layerwise
        ),
        default=0,
    )
    learner, learning = max(
        learning_bytes(model, stages, seq_len, quantized), key=lambda pair: pair[1], default=(None, 0)
    )
    if training:
        work = {"training": max(training_bytes(model, stages, shape, size, seq_len, processes))}
    else:
        work = {"calibration": calibration}
    if calibration and upcast and not streams and not training:  # the calibrated layer's float32 copy
        work["float32 layer"] = 4 * shape.layer_parameters
    if learning > sum(work.values()) and not training:  # the stages run one at a time: the larger need is the peak
        work = {learner.learning_label: learning}
    forecast = MemoryForecast(processes=processes)
    forecast.phases["stages"] = process | resident | work
    eval_work = eval_bytes(shape, logit_tokens, size, agreement_tokens) if logit_tokens else 0
    # where 16-bit matmuls are slow, the evals' forwards widen one decoder layer at a time (layers_in_float32)
    widened = widens_to_float32(getattr(torch, dtype), device)
    float32_layer = {"float32 layer": 4 * max(shape.layer_parameters, shape.vocab * shape.hidden)} if widened else {}
    if logit_tokens:  # the baseline is scored before any stage, on the whole float model
        forecast.phases["baseline eval"] = process | {"weights": float_model, "eval": eval_work} | float32_layer
    final_float = final_shape.parameters * size
    candidate = final_float - replaced + kept_table + float_head + quantized  # the stages' result
    # a W8A8 layer the evals run keeps a byte a weight beside its packed codes from its first forward on (for the CPU
    # kernel or transposed for _int_mm: QuantizedLinear._prepare_w8a8): the candidate's from the read-back's first
    # window, each artifact's from its check
    evaluated = candidate + sum(
        rows * cols for (rows, cols, *_), scheme, _ in plans.values() if scheme.int8_matmul_holds
    )
    # lmpress's runtime holds FP4 W4A4 layers' weights dequantized once, in the run's dtype
    # (kernels.dense.Fp4ActivationsLinear), integer W4A8 ones too where its CPU kernel does not hold their groups
    # (Int8ActivationsLinear; act-order, which the plan does not know, taken as absent), and FP8 W8A8 ones' E4M3
    # values in float32 beside their codes where no FP8 matmul runs (kernels.fp8.Fp8SimulatedLinear)
    runtime_model = candidate
    for (rows, cols, *rest), scheme, _ in plans.values():
        w4a8_kernel = device.type == "cpu" and scheme.bits == 4 and w4_fits(cols, rest[1], act_order=False)
        simulated = scheme.activations == "int8" and not scheme.int8_matmul_holds and not w4a8_kernel
        if (scheme.fp4 and scheme.activations) or simulated:
            runtime_model += rows * cols * size - packed_bytes(rows, cols, *rest)
        elif scheme.activations == "fp8" and not fp8_matmul_runs(device, rows, cols):
            runtime_model += rows * cols * 4
    if exports:
        sizes = [final_float + float_head if fmt in DENSE_FORMATS or not quantized else evaluated for fmt in exports]
        read_back = sizes[0]  # the first export is kept (it is scored), each other one only while it is checked
        forecast.phases["read-back"] = (
            process
            | {
                "candidate": evaluated,
                "read-back": read_back + max(sizes[1:], default=0),
                # one side's first-window forward at a time, its log-softmax by chunks (metrics.mean_token_nll)
                "logits": (agreement_tokens + min(agreement_tokens, NLL_CHUNK)) * shape.vocab * 4,
            }
            | pages_after
            | float32_layer
        )
        forecast.phases["runtime agreement"] = (
            process
            | {
                "candidate": evaluated,
                "read-back": read_back,
                "runtime model": runtime_model,
                "logits": 2
                * agreement_tokens
                * shape.vocab
                * 4,  # both sides', float32 (compared in float64 by blocks)
            }
            | pages_after
            | float32_layer
        )
        if logit_tokens:
            forecast.phases["candidate eval"] = (
                process | {"read-back": read_back, "eval": eval_work} | pages_after | float32_layer
            )
    elif logit_tokens:
        forecast.phases["candidate eval"] = (
            process | {"candidate": evaluated, "eval": eval_work} | pages_after | float32_layer
        )
    if device.type == "cuda":
        layer = 4 * shape.layer_parameters
        forecast.device_parts = {"layer": layer, "work": next(iter(work.values()))}
    return forecast


def skeleton_after(model: nn.Module, stages: Sequence) -> nn.Module:
    """``model`` (a skeleton on the meta device) as the stages' structural changes leave it: a reshaped copy, or
    ``model`` itself where no stage removes layers, heads or channels."""
    if not any(s.reshapes_model for s in stages):
        return model
    model = copy.deepcopy(model)
    for stage in stages:
        stage.reshape_skeleton(model)
    return model


def skeletons_before(model: nn.Module, stages: Sequence) -> Iterator[tuple[Any, nn.Module]]:
    """Each stage with ``model`` as the stages before it leave it: one copy, reshaped stage by stage as the loop
    goes (so each skeleton is read before the next is asked for), or ``model`` itself until a stage reshapes."""
    current = model
    for stage in stages:
        yield stage, current
        if stage.reshapes_model:
            current = copy.deepcopy(model) if current is model else current
            stage.reshape_skeleton(current)


def training_bytes(
    model: nn.Module, stages: Sequence, teacher: ModelShape, size: int, seq_len: int, processes: int
) -> list[int]:
    """What each training stage holds beside the weights: its student as the stages before it leave ``model``
    (layers removed, linears quantized), its teacher ``teacher`` (the model as loaded) or the one it names."""
    held = []
    for index, (stage, student) in enumerate(skeletons_before(model, stages)):
        if not stage.trains_across_processes:
            continue
        plans = [plan for plan, _, _ in linear_plans(student, stages[:index]).values()]
        weights = sum(rows * cols for rows, cols, *_ in plans)
        groups = sum(rows * (1 if width <= 0 else cols // width) for rows, cols, _, width, _ in plans)
        named = getattr(stage, "teacher", None)
        teacher_shape = teacher if named is None else named_teacher_shape(named)
        shape = ModelShape.of(student)
        held.append(stage.training_bytes(shape, teacher_shape, size, (weights, groups), seq_len, processes))
    return held


def named_teacher_shape(source: str) -> ModelShape:
    """The shape of the teacher a stage names (``DistillConfig.teacher``), from its config alone: a teacher larger
    than the student's model holds more than the model as loaded."""
    from lmpress.loader import model_skeleton, resolve_checkpoint

    return ModelShape.of(model_skeleton(resolve_checkpoint(source), weights=False))


def learning_bytes(model: nn.Module, stages: Sequence, seq_len: int, packed: int) -> list[tuple[Any, int]]:
    """Each stage with what it holds while it learns (``StageConfig.learning_bytes``), planned on the model as the
    stages before it leave ``model``; ``packed`` is the bytes of the packed weights the stages make."""
    return [
        (stage, stage.learning_bytes(ModelShape.of(learner), seq_len, packed))
        for stage, learner in skeletons_before(model, stages)
    ]


def linear_plans(model: nn.Module, stages: Sequence) -> dict[str, tuple[tuple[int, int, int, int, int], Any, Any]]:
    """Every linear the stages replace by a quantized one (``StageConfig.quantized_linears``): its (out, in, bits,
    group width, bytes per group: ``scale_bytes``), its scheme and the stage that plans it (a later stage's plan
    wins)."""
    planned = {}
    for stage in stages:
        for name, (linear, scheme) in stage.quantized_linears(model).items():
            cols = linear.in_features
            plan = (linear.out_features, cols, scheme.bits, scheme.group_width(cols), scale_bytes(scheme))
            planned[name] = (plan, scheme, stage)
    return planned


def fp8_matmul_runs(device: torch.device, rows: int, cols: int) -> bool:
    """Whether the runtime multiplies an FP8 layer of ``rows`` x ``cols`` in FP8 (``select.kernel_candidates``)."""
    return real_fp8_matmul_available(device) and rows % 16 == 0 and cols % 16 == 0


def eval_bytes(shape: ModelShape, logit_tokens: int, size: int, row_tokens: int) -> int:
    """One eval forward's logits in float32 (plus the model's own 16-bit logits) and one window's log-softmax
    (``row_tokens`` long)."""
    return logit_tokens * shape.vocab * (4 + (size if size < 4 else 0)) + row_tokens * shape.vocab * 4


def forecast_recipe(
    recipe: Recipe, model: nn.Module, checkpoint: Path, device: torch.device, processes: int = 1
) -> MemoryForecast:
    """``forecast_memory`` for a recipe run (``model``: the checkpoint's skeleton) in each of ``processes``.
    Fused mixture-of-experts weights are counted as the per-expert linears the run quantizes (``calib.moe``)."""
    from lmpress.calib.moe import unfuse_experts
    from lmpress.evals.perplexity import PerplexityConfig
    from lmpress.evals.suite import cache_sensitive

    with torch.device("meta"):
        unfuse_experts(model)
    perplexity = recipe.eval.evals.get("perplexity")  # the agreement check's window is its first (pipeline.py)
    forecast = forecast_memory(
        model,
        checkpoint,
        recipe.model.dtype,
        recipe.stages,
        recipe.data.samples,
        recipe.data.seq_len,
        device,
        logit_tokens=max((e.logit_tokens() for e in recipe.eval.evals.values()), default=0),
        exports=recipe.export.formats,
        agreement_tokens=perplexity.seq_len if isinstance(perplexity, PerplexityConfig) else 512,
        processes=processes,
        activations_ram=None if recipe.data.activations_ram_gb is None else int(recipe.data.activations_ram_gb * GIB),
    )
    if recipe.kv_cache is not None and cache_sensitive(recipe.eval.evals) and "candidate eval" in forecast.phases:
        # the same model scored once more on a float cache (pipeline.py): the candidate eval's memory, at most
        forecast.phases["candidate eval, float cache"] = dict(forecast.phases["candidate eval"])
    return forecast


def forecast_checkpoint(recipe: Recipe, processes: int = 1) -> MemoryForecast:
    """``recipe``'s forecast without running it (``lmpress forecast``): its model's skeleton is built from the
    config alone, so a directory holding only a giant's config.json will do."""
    from lmpress.loader import model_skeleton, resolve_checkpoint

    path = resolve_checkpoint(recipe.model.source, recipe.model.revision)
    skeleton = model_skeleton(path, recipe.model.trust_remote_code, weights=False)
    device = torch.device("cuda" if str(recipe.model.device).startswith("cuda") else "cpu")
    return forecast_recipe(recipe, skeleton, path, device, processes)


def available_memory(device: torch.device) -> tuple[int, int | None]:
    """Bytes of RAM the run can still take, and free memory on ``device`` when it is a GPU."""
    import psutil

    ram = psutil.virtual_memory().available
    free_device = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" and torch.cuda.is_available() else None
    return ram, free_device


def check_fits(forecast: MemoryForecast, available_ram: int, available_device: int | None = None) -> None:
    """Refuse a run whose forecast peak exceeds what the machine has (one line, exit 2)."""
    if forecast.ram_bytes > available_ram:
        raise LmpressInputError(
            f"this run needs about {forecast.ram_bytes / GIB:.1f} GiB of RAM and {available_ram / GIB:.1f} GiB "
            f"is available ({forecast.describe().split(': ', 1)[1]}): use a machine with more memory, fewer "
            "calibration samples or a shorter seq_len"
        )
    if available_device is not None and forecast.device_bytes > available_device:
        raise LmpressInputError(
            f"this run needs about {forecast.device_bytes / GIB:.1f} GiB of GPU memory and "
            f"{available_device / GIB:.1f} GiB is free: use model.device: cpu or a larger GPU"
        )
