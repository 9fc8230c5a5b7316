"""AWQ's tensor math: activation-aware per-channel scales and weight clipping.

Lin, Tang, Tang, Yang, Chen, Wang, Xiao, Dang, Gan, Han, "AWQ: Activation-aware
Weight Quantization for LLM Compression and Acceleration" (MLSys 2024,
arXiv:2306.00978).

Scaling input channel j of the linears that read a tensor X by s_j, and dividing
the same channel of X by s_j at its source (the preceding norm or linear), leaves
the float function unchanged: W X = (W diag(s)) (diag(s)⁻¹ X). Quantizing W diag(s)
instead of W lowers the relative rounding error of the salient channels (§3.2).
AWQ searches s = s_X^α with s_X the mean |X| per channel over a grid of α in
[0, 1) (Eq. 5), keeping the α whose quantized block output is closest to the
float one on the calibration inputs; then, per output row and group, a clipping
range max|w| · (1 - i/grid) that minimises the linear's output error.

FP4 schemes (NVFP4, MXFP4) search the same way with the FP4 grid as the quantizer: a trial's weights are
round-to-nearest E2M1 values under min/max block scales (``quantize_weight_fp4``), and a clipping trial is
the clamped block quantized so (its block scale follows the clipped range; NVFP4's global scale stays the
unclipped weight's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lmpress.calib.ranks import solve_across_ranks
from lmpress.weights.fp4 import E2M1_MAX, fake_quantize_e2m1, fp4_block_scales, nvfp4_global_scale, quantize_weight_fp4
from lmpress.weights.kquant import live_groups, snap_to_kquant_grid
from lmpress.weights.scheme import QuantScheme, compute_qparams, fake_quantize

SCALE_FLOOR = 1e-4


def fake_quantize_weight(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Round-to-nearest fake quantization of a ``(out, in)`` weight with min/max group scales (on the
    k-quant grid when the scheme asks for it, as RTN rounds; on the FP4 grid for an FP4 scheme)."""
    if scheme.fp4 is not None:
        return quantize_weight_fp4(w, scheme).dequantize(w.dtype)
    out_features, in_features = w.shape
    width = scheme.group_width(in_features)
    grouped = w.float().reshape(out_features, in_features // width, width)
    scale, zero = compute_qparams(grouped, scheme)
    if scheme.k_quant_scales:
        scale = snap_to_kquant_grid(scale, live_groups(grouped))
    return fake_quantize(grouped, scale[..., None], zero[..., None], scheme.maxq).reshape(w.shape).to(w.dtype)


def candidate_scales(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = s_X^α, normalised so that max(s) · min(s) = 1 (as the reference implementation does)."""
    s = x_mean.float().pow(alpha).clamp(min=SCALE_FLOOR)
    return s / (s.max() * s.min()).sqrt()


@torch.no_grad()
def search_scales(
    block: Callable[[], list[torch.Tensor]],
    linears: Sequence[nn.Linear],
    schemes: Sequence[QuantScheme],
    x_mean: torch.Tensor,
    grid: int,
    ranks: int = 1,
) -> tuple[torch.Tensor, list[float]]:
    """The per-channel scale for ``linears`` minimising the block output error (Eq. 4-5).

    ``block()`` runs the block on the search inputs and returns its outputs;
    during each trial the linears hold Q(W·s)/s, the quantized weights mapped back
    to the unscaled inputs. The weights are restored afterwards. Returns the best
    scale (the first of the least losses) and the loss of every α on the grid.
    ``ranks`` > 1: the launched processes share the grid's trials (``calib.ranks``), every one receives every
    loss; each must hold the same search inputs.
    """
    reference = block()
    originals = [linear.weight.data for linear in linears]  # each trial assigns new tensors; these stay intact

    def trial_loss(i: int) -> float:
        s = candidate_scales(x_mean, i / grid)
        try:
            for linear, scheme, w in zip(linears, schemes, originals, strict=True):
                linear.weight.data = fake_quantize_weight(w * s.to(w.dtype), scheme) / s.to(w.dtype)
            return sum(torch.mean((o.float() - r.float()) ** 2).item() for o, r in zip(block(), reference, strict=True))
        finally:
            for linear, w in zip(linears, originals, strict=True):
                linear.weight.data = w

    losses = list(solve_across_ranks(range(grid), lambda i: 1.0, trial_loss, ranks).values())
    best, best_loss = None, float("inf")
    for i, loss in enumerate(losses):
        if loss < best_loss:
            best, best_loss = i, loss
    if best is None:  # every trial's loss was NaN or infinite
        return torch.ones_like(x_mean, dtype=torch.float32), losses
    return candidate_scales(x_mean, best / grid), losses


@torch.no_grad()
def fold_scales(
    prev: nn.Module,
    linears: Sequence[nn.Linear],
    s: torch.Tensor,
    norm_offset: float = 0.0,
    rows: tuple[int, int] | None = None,
) -> None:
    """Divide ``prev``'s output channels by ``s`` and multiply the linears' input channels by it.

    ``prev`` is a norm (weight, optional bias: one value per channel) or a linear
    (rows = output channels, optional bias). A norm scaling by ``norm_offset + weight``
    (Gemma's ``1 + weight``) keeps its offset; ``rows`` (part, parts): only that slice of
    a fused linear's output rows feeds the linears (Phi-3's up half of gate_up_proj).
    """
    if isinstance(prev, nn.Linear):
        start, stop = _row_slice(prev.weight.shape[0], rows)
        prev.weight.data[start:stop].div_(s.to(prev.weight.dtype)[:, None])
        if prev.bias is not None:
            prev.bias.data[start:stop].div_(s.to(prev.bias.dtype))
    else:
        weight = prev.weight.data
        weight.copy_((weight.float() + norm_offset) / s.float() - norm_offset)
        if getattr(prev, "bias", None) is not None:
            prev.bias.data.div_(s.to(prev.bias.dtype))
    for linear in linears:
        linear.weight.data.mul_(s.to(linear.weight.dtype)[None, :])


def _row_slice(n_rows: int, rows: tuple[int, int] | None) -> tuple[int, int]:
    if rows is None:
        return 0, n_rows
    part, parts = rows
    width = n_rows // parts
    return part * width, (part + 1) * width


def can_fold(prev: nn.Module, linears: Sequence[nn.Linear], rows: tuple[int, int] | None = None) -> bool:
    """Whether ``prev``'s output channels (the ``rows`` slice of a fused linear's) line up one-to-one with the
    linears' input channels."""
    weight = getattr(prev, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return False
    channels = weight.shape[0]
    if not isinstance(prev, nn.Linear) and weight.dim() != 1:
        return False
    if rows is not None:
        if not isinstance(prev, nn.Linear) or channels % rows[1]:
            return False
        channels //= rows[1]
    return all(linear.in_features == channels for linear in linears)


@torch.no_grad()
def search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    scheme: QuantScheme,
    grid: int = 20,
    max_shrink: float = 0.5,
    rows_per_chunk: int = 256,
) -> torch.Tensor:
    """Per (row, group) clipping bound ``max|w| · (1 - i/grid)`` minimising the output error on ``x`` (tokens, in).

    Returns the bound, shape ``(out, n_groups)``; for asymmetric schemes the same
    shrink applies to both ends of the range.
    """
    out_features, in_features = w.shape
    width = scheme.group_width(in_features)
    n_groups = in_features // width
    xg = x.float().reshape(-1, n_groups, width)  # tokens, groups, width
    global_scale = nvfp4_global_scale(w) if scheme.fp4 == "nvfp4" else None
    best_shrink = torch.ones(out_features, n_groups, device=w.device)
    for r0 in range(0, out_features, rows_per_chunk):
        wg = w[r0 : r0 + rows_per_chunk].float().reshape(-1, n_groups, width)  # rows, groups, width
        reference = torch.einsum("tgw,rgw->rgt", xg, wg)
        best_err = torch.full(wg.shape[:2], float("inf"), device=w.device)
        for i in range(int(max_shrink * grid)):
            shrink = 1 - i / grid
            if scheme.fp4 is not None:
                q = _fp4_clipped(wg, shrink, scheme.fp4, global_scale)
            else:
                scale, zero = compute_qparams(wg, scheme, shrink)
                q = fake_quantize(wg, scale[..., None], zero[..., None], scheme.maxq)
            err = (torch.einsum("tgw,rgw->rgt", xg, q) - reference).pow(2).mean(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_shrink[r0 : r0 + rows_per_chunk][better] = shrink
    return best_shrink


def _fp4_clipped(blocks: torch.Tensor, shrink: float, fmt: str, global_scale: torch.Tensor | None) -> torch.Tensor:
    """What ``apply_clip`` then round-to-nearest FP4 leave of ``blocks`` (rows, blocks, width): each block clamped
    to ``±max|w| · shrink``, then quantized under the min/max scale of the clamped block."""
    bound = blocks.abs().amax(-1, keepdim=True) * shrink
    clipped = torch.maximum(torch.minimum(blocks, bound), -bound)
    scale = fp4_block_scales(clipped, fmt, global_scale)
    effective = (scale if global_scale is None else scale / global_scale)[..., None]
    return fake_quantize_e2m1((clipped / effective).clamp_(-E2M1_MAX, E2M1_MAX)) * effective


@torch.no_grad()
def apply_clip(linear: nn.Linear, shrink: torch.Tensor, scheme: QuantScheme) -> None:
    """Clamp each (row, group) of the weight into its shrunk min/max range.

    Min/max quantization of the clamped weight then uses exactly the clipped range,
    whichever rounding (RTN or GPTQ) follows.
    """
    w = linear.weight.data
    out_features, in_features = w.shape
    width = scheme.group_width(in_features)
    grouped = w.float().reshape(out_features, in_features // width, width)
    if scheme.symmetric:
        bound = grouped.abs().amax(-1) * shrink
        low, high = -bound, bound
    else:
        low = grouped.amin(-1).clamp(max=0) * shrink
        high = grouped.amax(-1).clamp(min=0) * shrink
    clipped = torch.maximum(torch.minimum(grouped, high[..., None]), low[..., None])
    # In place: the weight may be a page of the memory-mapped checkpoint, which the
    # layer-wise engine gives back once it is quantized; a new tensor would keep it resident.
    w.copy_(clipped.reshape(w.shape))
