"""FP4 rounding for the calibrated methods: GPTQ's per-column nearest-E2M1 step, and learned rounding's choice
between the two E2M1 values around each weight, with straight-through gradients (Bengio et al. 2013).

The grid, its codes and block scales are ``lmpress.weights.fp4``'s; these helpers only round onto it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmpress.weights.fp4 import E2M1_MAX, E2M1_VALUES, Fp4Format, fp4_block_scales
from lmpress.weights.scheme import round_ste, straight_through


def e2m1_rounder(device: torch.device | str) -> Callable[[torch.Tensor], None]:
    """In-place rounding of a vector (already divided by its scale) to the nearest E2M1 value, ties to the even
    mantissa as ``round_to_e2m1`` rounds (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 3.5 -> 4, 5 -> 4), past ±6 to ±6:
    three small ops where ``fake_quantize_e2m1`` takes some twenty, for GPTQ's column loop."""
    values = torch.tensor(E2M1_VALUES, device=device)
    midpoints = (values[1:] + values[:-1]) / 2
    # bucketize counts the bounds strictly below |x|; a tie rounds up where the upper value's code is even (its
    # mantissa bit 0: 1, 2, 4), so that bound moves one ulp down
    ties_up = torch.arange(1, len(E2M1_VALUES), device=device) % 2 == 0
    bounds = torch.where(ties_up, torch.nextafter(midpoints, torch.zeros_like(midpoints)), midpoints)

    def round_(q: torch.Tensor) -> None:
        q.copy_(torch.copysign(torch.take(values, torch.bucketize(q.abs(), bounds)), q))

    return round_


def signed_e2m1_grid(device: torch.device | str | None = None) -> torch.Tensor:
    """The 15 E2M1 values, -6 to 6, ascending."""
    magnitudes = torch.tensor(E2M1_VALUES, device=device)
    return torch.cat([-magnitudes[1:].flip(0), magnitudes])


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The E2M1 values ``lo <= x <= hi`` around each element of ``x`` (within ±6; ``lo < hi``)."""
    grid = signed_e2m1_grid(x.device)
    below = (torch.bucketize(x.detach().contiguous(), grid, right=True) - 1).clamp_(0, len(grid) - 2)
    return torch.take(grid, below), torch.take(grid, below.add_(1))  # take: a tenth of indexing's time on CPU


def round_between_neighbours(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``x`` (divided by its scale, clamped to ±6) to the E2M1 value below or above it: the one above where
    ``⌊t + v⌉ = 1``, ``t`` being x's position from the one below (0) to the one above (1). ``v = 0`` is
    round-to-nearest; straight-through, ``d/dx = 1`` and ``d/dv`` is the gap between the two values."""
    lo, hi = neighbours(x)
    gap = hi - lo
    return lo + gap * round_ste((x - lo) / gap + v)


def offsets_towards(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The ``v`` (unclamped) that takes ``x`` to the E2M1 value ``target`` in :func:`round_between_neighbours`,
    in units of the gap between x's neighbours (the FP4 counterpart of ``⌊Ŵ/s⌉ − W/s``)."""
    lo, hi = neighbours(x)
    return (target - x) / (hi - lo)


def block_scales_ste(
    amax: torch.Tensor, alpha: torch.Tensor, fmt: Fp4Format, global_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored scale, effective scale) of blocks whose range is clipped to ``amax · α``: forward, the encoding's
    min/max scale of that range (E4M3 under NVFP4's global scale, or a power of two: ``fp4_block_scales``);
    backward, the unrounded ``amax · α / 6`` (straight-through), so the clipping α learns by its gradient."""
    clipped = amax * alpha
    proxy = clipped / E2M1_MAX
    if global_scale is not None:
        proxy = proxy * global_scale
    with torch.no_grad():
        stored = fp4_block_scales(clipped.detach()[..., None], fmt, global_scale)  # one-element blocks: max = amax·α
    stored = straight_through(proxy, stored)
    return stored, stored if global_scale is None else stored / global_scale
