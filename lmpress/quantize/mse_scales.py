"""The integer grid's scale search by output error: each group's clipping range chosen for the least
Σ|w - fake_quant(w)|^2.4 (the reference GPTQ implementation's ``mse`` option). GPTQ runs it per group inside its
column loop; RTN and AWQ's final rounding run it once per weight."""

from __future__ import annotations

import torch

from lmpress.weights.scheme import QuantScheme, compute_qparams

MSE_GRID = 100
MSE_MAX_SHRINK = 0.8
MSE_NORM = 2.4
MSE_CHUNK_ELEMENTS = 2**19


def search_qparams_mse(
    w: torch.Tensor,
    scheme: QuantScheme,
    grid: int = MSE_GRID,
    max_shrink: float = MSE_MAX_SHRINK,
    norm: float = MSE_NORM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero per row of ``w`` minimising Σ|w - fake_quant(w)|^norm over shrunk min/max ranges.

    The grid of range shrink factors 1, 1 - 1/grid, ... down to 1 - max_shrink and
    the norm 2.4 follow the reference GPTQ implementation's ``mse`` option; the
    first minimum wins a tie.
    """
    w = w.float()
    shrinks = 1 - torch.arange(int(max_shrink * grid), device=w.device, dtype=torch.float32) / grid
    scales, zeros = compute_qparams(w, scheme, shrinks.reshape(-1, *([1] * (w.dim() - 1))))
    # A few candidates at a time bound the (candidates, *w.shape) buffer.
    chunk = max(1, MSE_CHUNK_ELEMENTS // w.numel())
    errors = []
    for scale, zero in zip(scales.split(chunk), zeros.split(chunk), strict=True):
        scale = scale[..., None]
        # fake_quantize(w) - w in place on one buffer; a symmetric grid's zero is a constant
        q = torch.div(w[None], scale).round_()
        if scheme.symmetric:
            mid = (scheme.maxq + 1) // 2
            q.clamp_(-mid, scheme.maxq - mid)
        else:
            zero = zero[..., None]
            q.add_(zero).clamp_(0, scheme.maxq).sub_(zero)
        err = q.mul_(scale).sub_(w[None]).abs_()
        # |err|^norm as exp(norm log|err|): half the time of pow with a fractional exponent on CPU
        errors.append(err.log_().mul_(norm).exp_().sum(-1))
    best = torch.cat(errors).argmin(dim=0, keepdim=True)
    return scales.gather(0, best)[0], zeros.gather(0, best)[0]
