"""The tensor math of learned rounding (``lmpress.quantize.learned_rounding_quantize``): the starting rounding, the
frozen weight against the fake-quantized one, gradients through the rounding, starts from other codes."""

from __future__ import annotations

import pytest
import torch

from lmpress.quantize.learned_rounding_quantize import (
    V_RANGE,
    Rounding,
    freeze,
    init_rounding,
    learned_fake_quantize,
)
from lmpress.weights.scheme import QuantizedWeight, QuantScheme, compute_qparams, quantize_to_int, quantize_weight_rtn

SCHEMES = [QuantScheme(4, 64, True), QuantScheme(3, 32, False), QuantScheme(2, -1, True), QuantScheme(8, 128, False)]


def weight(out: int = 48, cols: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=g) * 0.05
    w[:, 3] *= 12  # an outlier column, so clipping matters
    w[5, :64] = 0  # an all-zero group
    return w


def random_rounding(w: torch.Tensor, scheme: QuantScheme, seed: int = 1) -> Rounding:
    g = torch.Generator().manual_seed(seed)
    groups = (w.shape[0], w.shape[1] // scheme.group_width(w.shape[1]))
    return Rounding(
        v=torch.rand(w.shape, generator=g) - 0.5,
        alpha=0.5 + 0.5 * torch.rand(groups, generator=g),
        beta=0.5 + 0.5 * torch.rand(groups, generator=g),
    )


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.describe())
def test_the_starting_rounding_is_round_to_nearest(scheme):
    w = weight()
    rounding = init_rounding(w, scheme)
    rtn = quantize_weight_rtn(w, scheme)
    assert torch.equal(learned_fake_quantize(w, scheme, rounding), rtn.dequantize())
    frozen = freeze(w, scheme, rounding)
    assert torch.equal(frozen.qweight, rtn.qweight)
    assert torch.equal(frozen.scales, rtn.scales) and torch.equal(frozen.zeros, rtn.zeros)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.describe())
def test_the_frozen_weight_is_exactly_the_learned_fake_quantization(scheme):
    w = weight()
    rounding = random_rounding(w, scheme)
    frozen = freeze(w, scheme, rounding)
    assert frozen.qweight.dtype == torch.uint8 and int(frozen.qweight.max()) <= scheme.maxq
    assert torch.equal(frozen.dequantize(), learned_fake_quantize(w, scheme, rounding))
    # clipping shrinks the range: the codes differ from RTN's
    assert not torch.equal(frozen.qweight, quantize_weight_rtn(w, scheme).qweight)


@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda s: s.describe())
def test_gradients_reach_offsets_and_clipping_through_the_rounding(scheme):
    w = weight()
    rounding = init_rounding(w, scheme)
    x = torch.randn(32, w.shape[1], generator=torch.Generator().manual_seed(2))
    loss = ((x @ learned_fake_quantize(w, scheme, rounding).T - x @ w.T) ** 2).mean()
    loss.backward()
    assert rounding.v.grad.abs().sum() > 0 and rounding.alpha.grad.abs().sum() > 0
    assert (rounding.beta.grad is None) == scheme.symmetric or rounding.beta.grad.abs().sum() > 0


@pytest.mark.parametrize("scheme", [QuantScheme(4, 64, True), QuantScheme(3, 32, False)])
def test_a_start_with_searched_scales_is_reproduced_exactly(scheme):
    """init: gptq — a start whose scales shrink the min/max range (an MSE scale search) gives α = β = the shrink."""
    w = weight()
    grouped = w.reshape(w.shape[0], -1, scheme.group_size)
    shrink = 0.55 + 0.45 * torch.rand(grouped.shape[:2], generator=torch.Generator().manual_seed(2))
    scale, zero = compute_qparams(grouped, scheme, shrink)
    codes = quantize_to_int(grouped, scale[..., None], zero[..., None], scheme.maxq)
    start = QuantizedWeight(codes.reshape(w.shape).to(torch.uint8), scale, zero, scheme)
    frozen = freeze(w, scheme, init_rounding(w, scheme, start))
    assert torch.equal(frozen.qweight, start.qweight)
    torch.testing.assert_close(frozen.scales, scale)
    torch.testing.assert_close(frozen.zeros.float(), zero.float())


def test_a_start_from_other_codes_is_reproduced_within_the_offsets_range():
    """init: gptq — V from another rounding's codes on the same grid, clamped into [-0.5, 0.5]."""
    scheme = QuantScheme(4, 64, True)
    w = weight()
    rtn = quantize_weight_rtn(w, scheme)
    g = torch.Generator().manual_seed(4)
    shifted = (rtn.qweight.long() + torch.randint(-1, 2, w.shape, generator=g)).clamp(0, scheme.maxq)
    start = QuantizedWeight(shifted.to(torch.uint8), rtn.scales, rtn.zeros, scheme)
    rounding = init_rounding(w, scheme, start)
    assert rounding.v.min() >= V_RANGE[0] and rounding.v.max() <= V_RANGE[1]
    frozen = freeze(w, scheme, rounding)
    wanted = shifted - rtn.zeros.repeat_interleave(64, 1) - w / rtn.scales.repeat_interleave(64, 1)
    reachable = wanted.abs() < 0.5 - 1e-4
    assert reachable.float().mean() > 0.3
    assert torch.equal(frozen.qweight.long()[reachable], shifted[reachable])
    assert ((frozen.qweight.long() - shifted).abs() <= 1).all()


@pytest.mark.parametrize("bits", [4, 3])
def test_the_full_range_grid_puts_each_groups_extreme_on_code_zero(bits):
    """full_range at α = β = 1: s = −m/2^(b−1) with m the group's signed extreme (llama.cpp's Q4_0 grid, written
    here from its definition): the extreme is reproduced exactly, and the mean error is below the half-range grid's."""
    scheme = QuantScheme(bits, 64, True)
    w = weight()
    w[7, 64:128] *= -1  # groups whose extreme is negative and ones whose extreme is positive
    frozen = freeze(w, scheme, init_rounding(w, scheme, full_range=True))
    grouped = w.reshape(w.shape[0], -1, 64)
    extreme = grouped.gather(-1, grouped.abs().argmax(-1, keepdim=True))[..., 0]
    mid = 2 ** (bits - 1)
    live = extreme != 0
    assert (frozen.scales < 0).any() and (frozen.scales > 0).any()
    torch.testing.assert_close(frozen.scales[live], extreme[live] / -mid)
    q = (torch.round(grouped / frozen.scales[..., None]) + mid).clamp(0, 2 * mid - 1)
    assert torch.equal(frozen.qweight, q.reshape(w.shape).to(torch.uint8))
    dequantized = frozen.dequantize().reshape(grouped.shape)
    torch.testing.assert_close(dequantized.gather(-1, grouped.abs().argmax(-1, keepdim=True))[..., 0], extreme)
    full_error = (frozen.dequantize() - w).pow(2).mean()
    assert full_error < (quantize_weight_rtn(w, scheme).dequantize() - w).pow(2).mean()


def test_full_range_clipping_learns_each_side_and_starts_from_another_grids_weights():
    scheme = QuantScheme(4, 64, True)
    w = weight()
    rounding = init_rounding(w, scheme, full_range=True)
    x = torch.randn(32, w.shape[1], generator=torch.Generator().manual_seed(2))
    ((x @ learned_fake_quantize(w, scheme, rounding).T - x @ w.T) ** 2).mean().backward()
    assert rounding.alpha.grad.abs().sum() > 0 and rounding.beta.grad.abs().sum() > 0
    # a start on the half-range grid (GPTQ's): each weight goes to the full-range grid's point nearest the start's
    # value, where V's range [-0.5, 0.5] reaches it from W/s
    start = quantize_weight_rtn(w, scheme)
    rounding = init_rounding(w, scheme, start, full_range=True)
    frozen = freeze(w, scheme, rounding)
    scale = frozen.scales.repeat_interleave(64, 1)
    nearest = torch.round(start.dequantize() / scale)
    reachable = (nearest - w / scale).abs() < 0.5 - 1e-4
    assert reachable.float().mean() > 0.8
    assert torch.equal((frozen.qweight.float() - 8)[reachable], nearest[reachable])
    assert rounding.v.min() >= V_RANGE[0] and rounding.v.max() <= V_RANGE[1]
