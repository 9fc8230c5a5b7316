"""One truth per artifact: lmpress's runtime, its evaluator, the dequantized float reference and every
installed consumer agree on an export's next-token logits and greedy tokens.

Each way of running an export is a :class:`Side`: its logits at every position of a token sequence
and its greedy continuation of a prompt. Two sides agree when

- logits: ``max |a - b|`` over every position of the prompt set is at most the pair's tolerance, and
- greedy tokens: each prompt's continuation is the same, or the first token where they part is a near
  tie of the reference (its logits for the two tokens within twice the tolerance of each other).

The tolerance (:func:`tolerance`) is derived from how the two sides may legitimately differ while
running the same stored codes: ``K * u * M``. ``M`` is the largest reference logit magnitude on the
prompt set (the scale of the numbers compared), ``u`` the coarsest unit roundoff either side applies
beyond the artifact (:class:`Side`'s ``unit``: float32 ``2**-24`` (floored at ``2**-20`` for
reordered sums), float16-stored scales ``2**-11``, bfloat16 kernel activations ``2**-8``, one step of
dynamic int8 activation codes ``2**-7``, of E4M3 activation codes ``2**-4``, of E2M1 (FP4) activation codes
``2**-2``); a quantized KV cache reached by two different roundings adds a step of its codes (E4M3
``2**-4``, int8 ``2**-7``, int4 ``2**-4``: :func:`kv_cache_unit`), and ``K = 16`` a
safety factor for the rounding errors accumulated over the layers. ``K`` was measured, not guessed:
over every pair of the agreement matrix on the tiny random model and SmolLM2-135M, the largest
``max |a - b| / (u * M)`` seen is recorded in docs/agreement.md; a side that runs something else (the
W8A8 export's int8 codes read as float weights, a scale dropped) lands orders of magnitude above.

A recipe run checks the export it ships the same way (:func:`check_runtime_agreement`): lmpress's
runtime reads the export from disk and scores the first eval window; its logits must agree with the
evaluator's, or the run's gate fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmpress.runtime.kernels import DEFAULT_CPU_ACTIVATIONS
from lmpress.weights.kv_quant import KVQuant

FLOAT32_UNIT = 2.0**-20  # float32 sums in another order (2**-24 each), over a few thousand terms
FLOAT16_UNIT = 2.0**-11
BFLOAT16_UNIT = 2.0**-8
INT8_ACTIVATION_UNIT = 2.0**-7
FP8_ACTIVATION_UNIT = 2.0**-4
FP4_ACTIVATION_UNIT = 2.0**-2  # E2M1: one mantissa bit
DTYPE_UNIT = {"float32": FLOAT32_UNIT, "float16": FLOAT16_UNIT, "bfloat16": BFLOAT16_UNIT}  # a run's model.dtype
KV_CACHE_UNIT = {"int8": INT8_ACTIVATION_UNIT, "fp8": FP8_ACTIVATION_UNIT, "int4": 2.0**-4}  # a step of its codes
SAFETY = 16.0
TIE_FACTOR = 2.0  # a greedy split is a near tie when the reference's two logits lie within 2x the tolerance

Logits = Callable[[torch.Tensor], torch.Tensor]  # (1, T) token ids -> (T, vocab) float32
Greedy = Callable[[list[int], int], list[int]]  # prompt ids, n new tokens -> new token ids


@dataclass
class Side:
    """One way of running an export: its logits, its greedy decoding, and the unit roundoff it adds."""

    name: str
    logits: Logits
    greedy: Greedy
    unit: float


def greedy_by_logits(logits: Logits) -> Greedy:
    """Greedy decoding by re-reading the whole sequence each step (for sides without a cache of their own)."""

    def greedy(prompt: list[int], n: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(n):
            tokens.append(int(logits(torch.tensor([tokens]))[-1].argmax()))
        return tokens[len(prompt) :]

    return greedy


def hf_side(name: str, model: nn.Module, unit: float) -> Side:
    """A transformers causal LM as a side (lmpress's evaluator, transformers as a consumer)."""

    @torch.inference_mode()
    def logits(ids: torch.Tensor) -> torch.Tensor:
        device = next(model.parameters()).device
        return model(ids.to(device), use_cache=False).logits[0].float().cpu()

    return Side(name, logits, greedy_by_logits(logits), unit)


def runtime_side(model: nn.Module, unit: float) -> Side:
    """lmpress's runtime (``Transformer``): prefill through its KV cache, greedy through its own decode loop."""
    from lmpress.runtime.generate import generate_tokens
    from lmpress.runtime.sample import SamplingConfig

    @torch.inference_mode()
    def logits(ids: torch.Tensor) -> torch.Tensor:
        return model(ids, model.new_cache(1, ids.shape[1]))[0].float().cpu()

    @torch.inference_mode()
    def greedy(prompt: list[int], n: int) -> list[int]:
        steps = generate_tokens(model, prompt, max_new_tokens=n, sampling=SamplingConfig(temperature=0.0))
        return [int(step[0]) for step in steps]

    return Side("runtime", logits, greedy, unit)


def execution_unit(model: nn.Module, runtime: bool, cpu_activations: str = DEFAULT_CPU_ACTIVATIONS) -> float:
    """The unit roundoff of running ``model``'s layers (a model as ``load_model`` or a writer holds them):
    W8A8 layers quantize activations to int8 codes, FP8 layers to E4M3, W4A4 FP4 layers to E2M1 per block,
    bitsandbytes' ``Linear8bitLt`` to int8 and ``Linear4bit`` computes in bfloat16; FP4 weight-only layers run
    their dequantized weight in float32, except in the runtime's CPU int8 build (int8 activations per 4);
    weight-only ``QuantizedLinear`` layers run float32 in the
    evaluator and, in lmpress's runtime (``runtime``) built with ``cpu_activations`` (``load_runtime``'s), int8
    activations per 4 columns where that is "int8" and its CPU int8 kernels hold them, bfloat16 activations
    otherwise (torch's CPU kernels, the Triton kernels)."""
    unit = FLOAT32_UNIT
    for module in model.modules():
        kind = type(module).__name__
        activations = getattr(getattr(module, "scheme", None), "activations", None)
        if activations == "fp4":
            unit = max(unit, FP4_ACTIVATION_UNIT)
        elif activations == "int8" or kind == "Linear8bitLt":
            unit = max(unit, INT8_ACTIVATION_UNIT)
        elif kind == "Fp8Linear" or activations == "fp8":
            unit = max(unit, FP8_ACTIVATION_UNIT)
        elif runtime and kind == "QuantizedLinear" and runtime_quantizes_activations(module, cpu_activations):
            unit = max(unit, INT8_ACTIVATION_UNIT)
        elif runtime and kind == "Fp4Linear" and activations is None and cpu_activations == "int8":
            from lmpress.runtime.kernels.cpu_fp4 import refusal

            if refusal(module) is None:  # lmpress's FP4 x int8 CPU kernel runs it
                unit = max(unit, INT8_ACTIVATION_UNIT)
        elif kind == "Linear4bit" or (runtime and kind == "QuantizedLinear"):
            unit = max(unit, BFLOAT16_UNIT)
    return unit


def runtime_quantizes_activations(layer: nn.Module, cpu_activations: str = DEFAULT_CPU_ACTIVATIONS) -> bool:
    """Whether lmpress's CPU runtime, built with ``cpu_activations``, runs ``layer`` (a weight-only
    ``QuantizedLinear``) on its int8-activation kernels (``runtime/kernels/cpu_int.py``: int8 per 4 columns)."""
    from lmpress.runtime.kernels.cpu import int8_activation_kernel_fits

    return int8_activation_kernel_fits(layer, cpu_activations)


def tolerance(unit_a: float, unit_b: float, logit_scale: float) -> float:
    """The largest ``|logit_a - logit_b|`` two correct executions of one artifact may show (module docstring)."""
    return SAFETY * max(unit_a, unit_b) * logit_scale


@dataclass
class PairResult:
    """One side compared with another (the reference, or the evaluator) on the prompt set."""

    side: str
    against: str
    max_abs_diff: float
    tolerance: float
    unit: float
    logit_scale: float
    greedy_same: int  # prompts whose greedy continuation is identical
    greedy_ties: int  # prompts that part at a near tie of the reference
    prompts: int
    first_split: str = ""  # the first prompt that parted beyond a tie: where and which tokens

    @property
    def logits_agree(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    @property
    def greedy_agree(self) -> bool:
        return self.greedy_same + self.greedy_ties == self.prompts

    @property
    def agrees(self) -> bool:
        return self.logits_agree and self.greedy_agree

    @property
    def ratio(self) -> float:
        """``max |a - b| / (u * M)``: what the safety factor ``K`` must cover for this pair."""
        return self.max_abs_diff / (self.unit * self.logit_scale)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"agrees": self.agrees, "ratio": self.ratio}


@dataclass
class Reading:
    """A side's logits on each prompt (teacher-forced over prompt + continuation) and its greedy tokens."""

    logits: list[torch.Tensor] = field(default_factory=list)
    greedy: list[list[int]] = field(default_factory=list)


def read_side(side: Side, prompts: Sequence[list[int]], new_tokens: int) -> Reading:
    reading = Reading()
    for prompt in prompts:
        reading.logits.append(side.logits(torch.tensor([prompt])).double())
        reading.greedy.append(side.greedy(list(prompt), new_tokens))
    return reading


def logit_scale(reading: Reading) -> float:
    return max(float(logits.abs().max()) for logits in reading.logits)


def compare(
    side: Side,
    reading: Reading,
    against: Side,
    reference: Reading,
    prompts: Sequence[list[int]],
    scale: float,
    reference_logits: Logits,
) -> PairResult:
    """``side`` against ``against`` (whose reading is ``reference``); near ties judged by ``reference_logits``."""
    diff = max(float((a - b).abs().max()) for a, b in zip(reading.logits, reference.logits, strict=True))
    unit = max(side.unit, against.unit)
    tol = tolerance(side.unit, against.unit, scale)
    same = ties = 0
    first_split = ""
    for prompt, got, want in zip(prompts, reading.greedy, reference.greedy, strict=True):
        if got == want:
            same += 1
            continue
        k = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b) if got and want else 0
        if k >= min(len(got), len(want)):  # one stopped early (an EOS): the shorter is a prefix of the longer
            same += 1
            continue
        step = reference_logits(torch.tensor([list(prompt) + want[:k]]))[-1].double()
        if float(step[want[k]] - step[got[k]]) <= TIE_FACTOR * tol:
            ties += 1
        elif not first_split:
            first_split = f"prompt {len(prompt)} tokens, new token {k}: {got[k]} where {against.name} has {want[k]}"
    return PairResult(side.name, against.name, diff, tol, unit, scale, same, ties, len(prompts), first_split)


# A recipe run's check of the export it ships ------------------------------------------------------------


@dataclass
class RuntimeAgreement:
    """lmpress's runtime against lmpress's evaluator on the first eval window of the shipped export."""

    format: str
    max_abs_diff: float
    tolerance: float
    unit: float
    logit_scale: float
    top1_agreement: float  # fraction of positions whose argmax is the same
    error: str = ""  # the runtime could not run the export: why

    @property
    def passed(self) -> bool:
        return not self.error and self.max_abs_diff <= self.tolerance

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"passed": self.passed}

    def as_gate(self) -> dict[str, Any]:
        """The check as a gate verdict: a disagreement fails the run like a failed gate."""
        value = math.inf if self.error else self.max_abs_diff
        return {
            "gate": f"lmpress's runtime runs export {self.format} as the evaluator does (first-window logits "
            f"within {self.tolerance:.3g})",
            "metric": f"runtime_{self.format}_max_logit_diff",
            "op": "<=",
            "threshold": self.tolerance,
            "value": value,
            "passed": self.passed,
            "margin": self.tolerance - value,
            "detail": self.error
            or f"max |runtime - evaluator| {self.max_abs_diff:.3g}, top-1 agreement {self.top1_agreement:.4f}",
        }


def kv_cache_unit(kv: KVQuant | None, unit_before: float) -> float:
    """The unit a quantized KV cache adds when two sides reach it by different roundings (``unit_before``):
    an entry near a rounding boundary takes the next code on one side, a whole step of the cache's codes.
    On SmolLM2 with an E4M3 cache, two runs of lmpress's runtime differing only in their activations'
    rounding (int8 or bfloat16) part by as much (max |dlogit| 18.2 at 1,024 tokens, top-1 0.956) as the
    runtime and the evaluator do, while the float cache agrees within its own unit: the flips are the
    cache's, not a fault. Sides that both compute in float32 flip nearly no codes (``unit_before``)."""
    if kv is None or unit_before <= FLOAT32_UNIT:
        return FLOAT32_UNIT
    return KV_CACHE_UNIT[kv.scheme.dtype]


def max_abs_difference(a: torch.Tensor, b: torch.Tensor, rows: int = 128) -> float:
    """max |a - b| over two float32 logit tensors ``(tokens, vocabulary)``, computed in float64 (exact for float32
    inputs) ``rows`` at a time: no float64 copy of either (805 MB each at 2,048 x 49,152, the largest part of a
    recipe run's peak before)."""
    return max(float((a[i : i + rows].double() - b[i : i + rows].double()).abs().max()) for i in range(0, len(a), rows))


def check_runtime_agreement(
    fmt: str,
    export_dir: Path,
    evaluator: nn.Module,
    window: torch.Tensor,
    dtype: str = "float32",
    cpu_activations: str = DEFAULT_CPU_ACTIVATIONS,
    device: torch.device | str = "cpu",
    kv: KVQuant | None = None,
) -> RuntimeAgreement:
    """Load ``export_dir`` into lmpress's runtime on ``device`` (the run's) with ``cpu_activations`` and compare
    its logits on ``window`` ``(1, T)`` with those of ``evaluator`` (the export as lmpress's evaluator loaded it,
    in ``dtype``), within the unit of what the runtime runs. On the CPU the runtime computes in ``dtype``; on
    CUDA in bfloat16, as its kernels there do (``load_runtime``), so the CPU's kernels are never built there.
    With ``kv`` both read a cache quantized so (the evaluator's attention under ``kv_quantized``)."""
    from lmpress.calib.compute_dtype import layers_in_float32
    from lmpress.errors import LmpressInputError
    from lmpress.quantize.kv_attention import kv_quantized
    from lmpress.runtime.text import load_runtime

    with kv_quantized(evaluator, kv), layers_in_float32(evaluator):  # the evaluator computes as the evals do
        want = hf_side("evaluator", evaluator, execution_unit(evaluator, runtime=False)).logits(window)
    scale = float(want.abs().max())
    if torch.device(device).type != "cpu":
        dtype, cpu_activations = "bfloat16", "bf16"  # the unit of bf16 activations; no CPU kernel runs there
    try:
        model, _ = load_runtime(str(export_dir), device=device, dtype=dtype, cpu_activations=cpu_activations)
    except LmpressInputError as e:
        return RuntimeAgreement(fmt, math.inf, math.nan, math.nan, scale, 0.0, error=f"the runtime refused: {e}")
    model.kv_quant = kv
    unit = max(
        execution_unit(evaluator, runtime=True, cpu_activations=cpu_activations), DTYPE_UNIT.get(dtype, FLOAT32_UNIT)
    )
    unit = max(unit, kv_cache_unit(kv, unit_before=unit))
    got = runtime_side(model, unit).logits(window)
    del model
    diff = max_abs_difference(got, want)
    top1 = float((got.argmax(-1) == want.argmax(-1)).double().mean())
    return RuntimeAgreement(fmt, diff, tolerance(unit, unit, scale), unit, scale, top1)
