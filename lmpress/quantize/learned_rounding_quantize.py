"""The tensor math of learned rounding (SignRound, Cheng et al. 2023, arXiv:2309.05516): each weight's rounding
offset ``V`` and each group's clipping ``α`` / ``β``, the fake-quantized weight they give (differentiable in all
three, straight-through rounding) and its packed form. The layer-wise training around it is
``lmpress.quantize.learned_rounding``; its docstring has the equations and the FP4 variant."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmpress.quantize.fp4_rounding import block_scales_ste, offsets_towards, round_between_neighbours
from lmpress.weights.fp4 import E2M1_MAX, Fp4Weight, nvfp4_global_scale, round_to_e2m1
from lmpress.weights.scheme import QuantizedWeight, QuantScheme, round_ste

V_RANGE = (-0.5, 0.5)
CLIP_RANGE = (0.5, 1.0)


@dataclass
class Rounding:
    """The learnable state of one linear: rounding offsets ``v`` (out, in) and clipping factors
    ``alpha`` (max side) and ``beta`` (min side), (out, n_groups); ``full_range``: which symmetric grid."""

    v: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    full_range: bool = False

    def tensors(self) -> list[torch.Tensor]:
        return [self.v, self.alpha, self.beta]

    def clone(self) -> Rounding:
        return Rounding(*(t.detach().clone() for t in self.tensors()), full_range=self.full_range)


def _grouped(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    out_features, in_features = w.shape
    if not scheme.fits(in_features):
        raise ValueError(scheme.misfit(in_features))
    width = scheme.group_width(in_features)
    return w.float().reshape(out_features, in_features // width, width)


def init_rounding(
    w: torch.Tensor,
    scheme: QuantScheme,
    start: QuantizedWeight | Fp4Weight | None = None,
    requires_grad: bool = True,
    full_range: bool = False,
) -> Rounding:
    """V = 0, α = β = 1 (round-to-nearest with min/max scales); or as near ``start`` (e.g. GPTQ's codes with
    MSE-searched scales) as the grid allows: α = β = the ratio of its step to the unclipped grid's (a uniform
    shrink of the range, as the scale search makes; clamped into [0.5, 1]) and ``V = ⌊Ŵ/s⌉ − W/s`` with Ŵ its
    dequantized weight, clamped into [−0.5, 0.5] (on ``start``'s own grid: V = q − zp − W/s).
    FP4: α from ``start``'s block scales, V towards its E2M1 values in units of the gap (:func:`fp4_start`)."""
    if scheme.fp4 is not None:
        v, alpha = fp4_start(w, scheme, start)
        rounding = Rounding(v.reshape(w.shape).contiguous(), alpha, alpha.clone(), full_range)
        for t in rounding.tensors():
            t.requires_grad_(requires_grad)
        return rounding
    grouped = _grouped(w, scheme)
    alpha = torch.ones(grouped.shape[:2], device=w.device)
    v = torch.zeros_like(grouped)
    if start is not None:
        unclipped, _ = learned_qparams(grouped, scheme, alpha, alpha, full_range)
        start_scale = start.scales.to(w.device).float().reshape(alpha.shape)
        alpha = (start_scale.abs() / unclipped.abs()).clamp(*CLIP_RANGE)
        scale = learned_qparams(grouped, scheme, alpha, alpha, full_range)[0][..., None]
        start_weight = _grouped(start.dequantize().to(w.device), scheme)
        v = (torch.round(start_weight / scale) - grouped / scale).clamp(*V_RANGE)
    rounding = Rounding(v.reshape(w.shape).contiguous(), alpha, alpha.clone(), full_range)
    for t in rounding.tensors():
        t.requires_grad_(requires_grad)
    return rounding


def learned_qparams(
    grouped: torch.Tensor, scheme: QuantScheme, alpha: torch.Tensor, beta: torch.Tensor, full_range: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero of each (row, group) of ``grouped`` with the range clipped by α (max) and β (min);
    differentiable in α and β, and equal to ``compute_qparams`` at α = β = 1 (without ``full_range``)."""
    maxq = scheme.maxq
    if scheme.symmetric and full_range:
        high = grouped.amax(dim=-1).clamp(min=0) * alpha
        low = grouped.amin(dim=-1).clamp(max=0) * beta
        scale = torch.where(high >= -low, high, low) / -float((maxq + 1) // 2)  # s = −m / 2^(b−1)
        zero = torch.full_like(scale, float((maxq + 1) // 2))
    elif scheme.symmetric:
        scale = 2 * grouped.abs().amax(dim=-1) * alpha / maxq  # s = 2·max|W|·α / (2^b − 1)
        zero = torch.full_like(scale, float((maxq + 1) // 2))  # zp = 2^(b−1)
    else:
        wmin = (grouped.amin(dim=-1) * beta).clamp(max=0)
        wmax = (grouped.amax(dim=-1) * alpha).clamp(min=0)
        scale = (wmax - wmin) / maxq  # s = (max·α − min·β) / (2^b − 1)
        zero = round_ste(-wmin / scale.clamp(min=torch.finfo(torch.float32).tiny)).clamp(0, maxq)  # zp = ⌊−min·β/s⌉
    scale = torch.where(scale != 0, scale, torch.ones_like(scale))  # an all-zero group (as compute_qparams)
    return scale, zero


def learned_fake_quantize(w: torch.Tensor, scheme: QuantScheme, rounding: Rounding) -> torch.Tensor:
    """W~ of ``w`` (out, in) in float32, differentiable in V, α and β (straight-through rounding)."""
    if scheme.fp4 is not None:
        q, effective, _ = _fp4_learned(w, scheme, rounding)
        return (q * effective[..., None]).reshape(w.shape)
    grouped = _grouped(w, scheme)
    scale, zero = learned_qparams(grouped, scheme, rounding.alpha, rounding.beta, rounding.full_range)
    scale, zero = scale[..., None], zero[..., None]
    q = torch.clamp(round_ste(grouped / scale + rounding.v.reshape(grouped.shape)) + zero, 0, scheme.maxq)  # W~
    return ((q - zero) * scale).reshape(w.shape)  # W~


# FP4: each block's scale from its max clipped by α (E4M3 under NVFP4's global scale, or a power of two; a
# straight-through gradient for α) and each weight to the E2M1 value below or above it, the one above where
# ⌊t + V⌉ = 1 with t its position between the two (V = 0: round-to-nearest); β is unused (the grid is symmetric).


def _fp4_learned(
    w: torch.Tensor, scheme: QuantScheme, rounding: Rounding
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E2M1 values (out, n_blocks, block), effective block scales, stored block scales) of the learned rounding."""
    grouped = _grouped(w, scheme)
    global_scale = nvfp4_global_scale(w) if scheme.fp4 == "nvfp4" else None
    stored, effective = block_scales_ste(grouped.abs().amax(-1), rounding.alpha, scheme.fp4, global_scale)
    x = (grouped / effective[..., None]).clamp(-E2M1_MAX, E2M1_MAX)
    return round_between_neighbours(x, rounding.v.reshape(grouped.shape)), effective, stored  # W~


@torch.no_grad()
def fp4_start(w: torch.Tensor, scheme: QuantScheme, start: Fp4Weight | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(V, α) of round-to-nearest with min/max block scales, or as near ``start``'s values as the offsets reach:
    α = its block scale / the unclipped one (clamped into [0.5, 1]), V towards its E2M1 values (in [−0.5, 0.5])."""
    grouped = _grouped(w, scheme)
    alpha = torch.ones(grouped.shape[:2], device=w.device)
    if start is None:
        return torch.zeros_like(grouped), alpha
    global_scale = nvfp4_global_scale(w) if scheme.fp4 == "nvfp4" else None
    amax = grouped.abs().amax(-1)
    unrounded = amax / E2M1_MAX * (1.0 if global_scale is None else global_scale)  # the scale α = 1 rounds
    alpha = (start.scales.to(w.device).float() / unrounded).nan_to_num(1.0).clamp(*CLIP_RANGE)
    _, effective = block_scales_ste(amax, alpha, scheme.fp4, global_scale)
    x = (grouped / effective[..., None]).clamp(-E2M1_MAX, E2M1_MAX)
    target = _grouped(start.dequantize().to(w.device), scheme) / effective[..., None]
    return offsets_towards(x, target).clamp(*V_RANGE), alpha


@torch.no_grad()
def freeze(w: torch.Tensor, scheme: QuantScheme, rounding: Rounding) -> QuantizedWeight | Fp4Weight:
    """The learned rounding of ``w`` in the packed form: its dequantized weight is exactly
    :func:`learned_fake_quantize`'s value."""
    if scheme.fp4 is not None:
        q, _, stored = _fp4_learned(w, scheme, rounding)
        global_scale = nvfp4_global_scale(w).cpu() if scheme.fp4 == "nvfp4" else None
        return Fp4Weight(round_to_e2m1(q).reshape(w.shape), stored, scheme, global_scale)
    grouped = _grouped(w, scheme)
    alpha, beta = rounding.alpha.detach(), rounding.beta.detach()
    scale, zero = learned_qparams(grouped, scheme, alpha, beta, rounding.full_range)
    v = rounding.v.detach().reshape(grouped.shape)
    # ⌊W/s + V⌉ as learned_fake_quantize computes it (round_ste's forward value is exactly torch.round's).
    q = torch.clamp(torch.round(grouped / scale[..., None] + v) + zero[..., None], 0, scheme.maxq)
    return QuantizedWeight(qweight=q.reshape(w.shape).to(torch.uint8), scales=scale, zeros=zero, scheme=scheme)
