"""Read every export back from disk and check it against the candidate quantized in memory.

The gate must score what ships. After export, each artifact is loaded by
lmpress's own loader (``load_model``: the same code ``lmpress eval`` and the
runtime use) and checked two ways:

- weights: every quantized layer holds the candidate's codes, zero points and
  act-order ``g_idx`` exactly, and its scales are the candidate's rounded to the
  dtype the format stores (float16 for GPTQ and AWQ; compressed-tensors keeps
  float32); a dense export holds exactly the candidate's dequantized weights;
  every other tensor (embeddings, norms, biases) is equal. The largest change
  of a dequantized weight (what float16 scales cost) is reported.
- output: the artifact and the candidate score the first evaluation window; their
  perplexities may differ by at most ``WINDOW_PPL_TOLERANCE`` (relative).

The first listed format's artifact is then the model the whole eval suite runs on.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from lmpress.weights.fp4 import Fp4Linear
from lmpress.weights.online_rotation import input_rotation_of, rotate_weight_input
from lmpress.weights.qlinear import QuantizedLinear

FP4_BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", "bias")

# Float16 scales move each weight by at most half a float16 step of its scale times the code's distance
# from the zero point. On SmolLM2 (GPTQ W4 g64, bench/export_readback.py) that moved the reference
# perplexity of the exports by 5.4e-5 (GPTQ, act-order) and 7e-6 (GPTQ and AWQ, static groups) of
# itself. A thousandth leaves room for that and still catches a wrong config (norm epsilon, rope
# settings), which the weight check cannot see.
WINDOW_PPL_TOLERANCE = 1e-3


@dataclass
class ExportCheck:
    format: str
    weights_match: bool
    weights: str  # what matched, or the first mismatch
    max_weight_change: float  # largest |dequantized artifact weight - candidate weight|
    window_ppl: float  # the artifact's perplexity on the first eval window
    candidate_window_ppl: float
    tolerance: float = WINDOW_PPL_TOLERANCE

    @property
    def window_ppl_change(self) -> float:
        return abs(self.window_ppl / self.candidate_window_ppl - 1.0)

    @property
    def passed(self) -> bool:
        return self.weights_match and self.window_ppl_change <= self.tolerance

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"window_ppl_change": self.window_ppl_change, "passed": self.passed}

    def as_gate(self) -> dict[str, Any]:
        """The check as a gate verdict, so a failed check fails the run like a failed gate."""
        return {
            "gate": f"export {self.format} matches the candidate (weights; first-window ppl within {self.tolerance:g})",
            "metric": f"export_{self.format}_window_ppl_change",
            "op": "<=",
            "threshold": self.tolerance,
            "value": self.window_ppl_change if self.weights_match else math.inf,
            "passed": self.passed,
            "margin": self.tolerance - self.window_ppl_change if self.weights_match else -math.inf,
            "detail": self.weights,
        }


def compare_weights(candidate: nn.Module, artifact: nn.Module) -> tuple[str | None, float, str]:
    """(first mismatch or None, largest dequantized-weight change, how the quantized layers' scales were stored)."""
    quantized = {name: m for name, m in candidate.named_modules() if isinstance(m, (QuantizedLinear, Fp4Linear))}
    packed = {f"{name}.{b}" for name in quantized for b in ("qweight", "scales", "zeros", "g_idx", *FP4_BUFFERS)}
    art_state = artifact.state_dict()
    for key, value in candidate.state_dict().items():
        if key in packed:
            continue
        if key not in art_state:
            return f"{key} is missing from the artifact", math.nan, ""
        if not torch.equal(art_state[key], value.to(art_state[key].dtype)):
            return f"{key} differs from the candidate's", math.nan, ""
    largest, stored = 0.0, set()
    for name, module in quantized.items():
        mismatch, change, scale_dtype = _compare_layer(name, module, artifact.get_submodule(name))
        if mismatch:
            return mismatch, math.nan, ""
        largest = max(largest, change)
        stored.add(scale_dtype)
    how = ", ".join(sorted(stored)) if stored else "no quantized layers"
    return None, largest, how


def _compare_fp4(name: str, cand: Fp4Linear, art: Fp4Linear) -> tuple[str | None, float, str]:
    """An FP4 layer read back: the same format, codes, block scales and global scales, bit for bit."""
    if art.scheme != cand.scheme:
        return f"{name}: stored as {art.scheme.describe()}, the candidate is {cand.scheme.describe()}", 0.0, ""
    for buffer in FP4_BUFFERS[:-1]:
        a, c = getattr(art, buffer), getattr(cand, buffer)
        if (a is None) != (c is None) or (a is not None and not torch.equal(a.view(torch.uint8), c.view(torch.uint8))):
            return f"{name}: {buffer} differs from the candidate's", 0.0, ""
    if (art.bias is None) != (cand.bias is None) or (art.bias is not None and not torch.equal(art.bias, cand.bias)):
        return f"{name}: bias differs from the candidate's", 0.0, ""
    return None, 0.0, f"{cand.fmt.upper()}, scales as {'E4M3' if cand.fmt == 'nvfp4' else 'E8M0'}"


def _compare_layer(name: str, cand: QuantizedLinear | Fp4Linear, art: nn.Module) -> tuple[str | None, float, str]:
    if isinstance(cand, Fp4Linear) and isinstance(art, Fp4Linear):
        return _compare_fp4(name, cand, art)
    if isinstance(art, QuantizedLinear) and isinstance(cand, QuantizedLinear):
        if art.scheme.bits != cand.scheme.bits or art.scales.shape != cand.scales.shape:
            return f"{name}: stored as {art.scheme.describe()}, the candidate is {cand.scheme.describe()}", 0.0, ""
        if not torch.equal(art.codes(), cand.codes()) or not torch.equal(art.zeros, cand.zeros):
            return f"{name}: integer codes or zero points differ from the candidate's", 0.0, ""
        if not _same_groups(art, cand):
            return f"{name}: act-order g_idx differs from the candidate's", 0.0, ""
        if not torch.equal(art.scales, cand.scales.to(art.scales.dtype)):
            return f"{name}: scales differ from the candidate's beyond rounding to {art.scales.dtype}", 0.0, ""
        if (art.bias is None) != (cand.bias is None) or (art.bias is not None and not torch.equal(art.bias, cand.bias)):
            return f"{name}: bias differs from the candidate's", 0.0, ""
        change = (art.dequantized_weight() - cand.dequantized_weight()).abs().max().item()
        return None, change, f"quantized, scales as {str(art.scales.dtype).removeprefix('torch.')}"
    if isinstance(art, nn.Linear):
        expected = cand.dequantized_weight(art.weight.dtype)
        rotation = input_rotation_of(cand)
        if rotation is not None and input_rotation_of(art) is None:  # hf: R4's turn folded back (dense_state_dict)
            expected = rotate_weight_input(expected, rotation.block)
        if not torch.equal(art.weight, expected):
            diff = (art.weight.float() - expected.float()).abs().max().item()
            return f"{name}: dense weight differs from the candidate's dequantized weight (max {diff:.3g})", 0.0, ""
        if cand.bias is not None and not torch.equal(art.bias, cand.bias.to(art.bias.dtype)):
            return f"{name}: bias differs from the candidate's", 0.0, ""
        return None, 0.0, "dense, dequantized"
    return f"{name}: the artifact holds a {type(art).__name__} where the candidate has a quantized linear", 0.0, ""


def _same_groups(a: QuantizedLinear, b: QuantizedLinear) -> bool:
    from lmpress.export.formats import act_order_g_idx

    ga, gb = act_order_g_idx(a), act_order_g_idx(b)
    return (ga is None and gb is None) or (ga is not None and gb is not None and torch.equal(ga.long(), gb.long()))


@torch.inference_mode()
def window_ppl(model: nn.Module, window: torch.Tensor) -> float:
    """Perplexity of ``model`` on one ``(1, seq_len)`` token window (every next token scored), computed as the evals
    compute (``layers_in_float32``)."""
    from lmpress.calib.compute_dtype import layers_in_float32
    from lmpress.memory import large_frees_unmapped
    from lmpress.metrics import mean_token_nll

    device = next(model.parameters()).device
    # each layer's activations handed back as they are freed: kept in glibc's heap, they sat beside the logits and
    # their log-softmax: the candidate's check rose 1.21-1.27 -> 0.95 GiB over its start (SmolLM2 W8A8, 2,048 tokens)
    with layers_in_float32(model), large_frees_unmapped():
        logits = model(window.to(device), use_cache=False).logits
        return math.exp(mean_token_nll(logits, window))


def check_export(
    fmt: str, candidate: nn.Module, artifact: nn.Module, window: torch.Tensor, candidate_window_ppl: float
) -> ExportCheck:
    """Check the artifact read back from ``fmt`` against ``candidate`` (whose window perplexity is given)."""
    mismatch, change, how = compare_weights(candidate, artifact)
    return ExportCheck(
        format=fmt,
        weights_match=mismatch is None,
        weights=mismatch or f"identical to the candidate ({how})",
        max_weight_change=change,
        window_ppl=window_ppl(artifact, window),
        candidate_window_ppl=candidate_window_ppl,
    )
