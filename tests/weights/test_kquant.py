"""The k-quant scale grid: d on 5 significant bits, d * sc exact in float16, and recovering (d, sc) from scales."""

from __future__ import annotations

import pytest
import torch

from lmpress.weights.kquant import FP16_QUANTUM, SCALE_MAX, kquant_grid, snap_scales, snap_to_kquant_grid, super_scale
from lmpress.weights.scheme import QuantScheme, compute_qparams, quantize_weight_rtn


def significant_bits(x: torch.Tensor) -> torch.Tensor:
    """Bits from the leading to the trailing 1 of each positive float's mantissa."""
    mantissa, _ = torch.frexp(x.double())
    bits = torch.zeros_like(x, dtype=torch.long)
    m = mantissa.clone()
    for _ in range(60):
        nonzero = m != 0
        bits += nonzero.long()
        m = torch.where(nonzero, (m * 2) - torch.floor(m * 2), m)
    return bits


def test_super_scale_has_five_significant_bits_and_every_product_is_a_float16():
    gen = torch.Generator().manual_seed(0)
    # maxima from float16's subnormal range (d below 2**-24 * 32) to ~1000
    scales = torch.exp(torch.empty(4000, 8).uniform_(-22, 7, generator=gen))
    d = super_scale(scales)
    assert torch.all(significant_bits(d) <= 5)
    assert torch.all(torch.remainder(d.double() / FP16_QUANTUM, 1) == 0)  # a multiple of float16's smallest step
    assert torch.all(d >= scales.amax(-1) / SCALE_MAX)  # rounded up: the largest group keeps its range
    assert torch.all(torch.round(scales.amax(-1) / d) <= SCALE_MAX)
    products = d[:, None] * torch.arange(SCALE_MAX + 1, dtype=torch.float32)
    assert torch.equal(products.half().float(), products)


def test_super_scale_is_the_next_five_bit_number_above_max_over_63():
    d = super_scale(torch.tensor([[63 * 0.75, 1, 0, 0, 0, 0, 0, 0], [63 * 0.7501, 0, 0, 0, 0, 0, 0, 0]]))
    assert d.tolist() == [0.75, 0.78125]  # 0.75 = 0b0.11000; the next 5-bit number up is 0b0.11001
    assert super_scale(torch.zeros(1, 8)).tolist() == super_scale(torch.ones(1, 8)).tolist()


def test_snapped_scales_are_multiples_of_d_between_1_and_63():
    d = torch.tensor([0.5])
    assert snap_scales(torch.tensor([0.1, 0.3, 0.76, 10.0, 40.0]), d).tolist() == [0.5, 0.5, 1.0, 10.0, 31.5]


def test_snap_to_kquant_grid_ignores_all_zero_groups_for_d():
    scales = torch.full((1, 16), 0.01)
    scales[0, 3] = 1.0  # compute_qparams' scale of an all-zero group
    live = torch.ones(1, 16, dtype=torch.bool)
    live[0, 3] = False
    snapped = snap_to_kquant_grid(scales, live)
    d = super_scale(torch.full((1, 8), 0.01))
    assert torch.equal(snapped[0, :3], snap_scales(scales[0, :3], d))
    assert snapped[0, 3] == d * SCALE_MAX  # any positive scale reproduces zeros
    with pytest.raises(ValueError, match="do not fill 256-column super-blocks"):
        snap_to_kquant_grid(torch.ones(1, 12), torch.ones(1, 12, dtype=torch.bool))


def test_kquant_grid_recovers_the_greatest_d():
    d = torch.tensor(0.00390625 * 1.25)  # 5 significant bits
    sc = torch.tensor([[2, 4, 6, 8, 62, 10, 12, 14], [1, 63, 5, 7, 9, 11, 13, 15]], dtype=torch.uint8)
    scales = (d * sc.float()).half().reshape(1, 16)
    got_d, got_sc = kquant_grid(scales)
    assert got_d.dtype == torch.float16 and got_sc.dtype == torch.uint8
    assert got_d.tolist() == [[float(2 * d), float(d)]]  # every sc of the first super-block is even
    assert torch.equal(got_sc[0, 0], sc[0] // 2) and torch.equal(got_sc[0, 1], sc[1])


def test_kquant_grid_refuses_scales_off_every_grid():
    gen = torch.Generator().manual_seed(1)
    random = (torch.rand(4, 8, generator=gen) + 0.5).half()
    assert kquant_grid(random) is None
    assert kquant_grid(torch.tensor([[1.0, 64.0, 1, 1, 1, 1, 1, 1]]).half()) is None  # 64 needs 7 bits
    assert kquant_grid(torch.ones(1, 4).half()) is None  # not whole super-blocks
    assert kquant_grid(torch.ones(1, 8)) is None  # float32: not what a file stores
    assert kquant_grid(-torch.ones(1, 8).half()) is None
    assert kquant_grid(torch.full((1, 8), 60000.0).half()) is None  # dmin = 8 * d overflows float16


def test_kquant_grid_holds_subnormal_d():
    d = torch.tensor(FP16_QUANTUM * 19)
    sc = torch.arange(56, 64, dtype=torch.uint8)[None]
    got_d, got_sc = kquant_grid((d * sc.float()).half())
    assert got_d.item() == d.item() and torch.equal(got_sc[0], sc)


def test_scheme_needs_w4_g32_sym():
    assert QuantScheme(4, 32, True, k_quant_scales=True).describe() == "W4 g32 sym k-quant scales"
    for bits, group, sym in ((8, 32, True), (4, 64, True), (4, 32, False)):
        with pytest.raises(ValueError, match="k_quant_scales .* need bits: 4, group_size: 32, symmetric: true"):
            QuantScheme(bits, group, sym, k_quant_scales=True)
    scheme = QuantScheme(4, 32, True, k_quant_scales=True)
    assert scheme.fits(512) and not scheme.fits(576)
    assert scheme.misfit(576) == "k-quant scales need in_features divisible by 256, got 576"


def test_rtn_with_kquant_scales_rounds_to_the_snapped_scales():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 768, generator=gen) * torch.linspace(0.01, 2, 768)
    w[5, 64:96] = 0  # an all-zero group
    scheme = QuantScheme(4, 32, True, k_quant_scales=True)
    qw = quantize_weight_rtn(w, scheme)
    grouped = w.reshape(48, 24, 32)
    plain, _ = compute_qparams(grouped, scheme)
    expected = snap_to_kquant_grid(plain, grouped.abs().amax(-1) > 0)
    assert torch.equal(qw.scales, expected)
    assert torch.equal(qw.scales.half().float(), qw.scales)
    assert kquant_grid(qw.scales.half()) is not None
    codes = torch.clamp(torch.round(grouped / expected[..., None]) + 8, 0, 15).reshape(48, 768)
    assert torch.equal(qw.qweight, codes.to(torch.uint8))
    assert torch.all(qw.dequantize()[5, 64:96] == 0)


def test_kquant_scales_cost_rtn_little():
    """6-bit scales relative to each super-block's largest: the scale error is at most 1/(2 sc) of it."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(256, 1024, generator=gen) * torch.rand(256, 1024, generator=gen).pow(4)
    plain = quantize_weight_rtn(w, QuantScheme(4, 32, True)).dequantize()
    snapped = quantize_weight_rtn(w, QuantScheme(4, 32, True, k_quant_scales=True)).dequantize()
    assert ((snapped - w) ** 2).mean() < 1.05 * ((plain - w) ** 2).mean()
