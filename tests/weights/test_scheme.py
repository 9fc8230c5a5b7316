import numpy as np
import pytest
import torch

from lmpress.weights.scheme import QuantScheme, compute_qparams, quantize_weight_rtn


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    return float(10 * torch.log10(reference.pow(2).sum() / (reference - approx).pow(2).sum()))


def reference_rtn(w: torch.Tensor, bits: int, group: int, symmetric: bool) -> torch.Tensor:
    """Element by element, straight from the convention in scheme.py's docstring (float32 arithmetic)."""
    out = torch.empty_like(w)
    maxq = np.float32(2**bits - 1)
    for r in range(w.shape[0]):
        for g0 in range(0, w.shape[1], group):
            values = w[r, g0 : g0 + group].numpy().astype(np.float32)
            if symmetric:
                scale = np.float32(2) * np.abs(values).max() / maxq
                zero = np.float32((maxq + 1) // 2)
            else:
                lo, hi = min(values.min(), np.float32(0)), max(values.max(), np.float32(0))
                scale = (hi - lo) / maxq
                zero = np.round(-lo / scale)
            for j, v in enumerate(values):
                q = min(max(np.round(v / scale) + zero, 0), maxq)
                out[r, g0 + j] = float((q - zero) * scale)
    return out


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_rtn_matches_elementwise_reference(bits, symmetric):
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(bits))
    qw = quantize_weight_rtn(w, QuantScheme(bits, 32, symmetric))
    torch.testing.assert_close(qw.dequantize(), reference_rtn(w, bits, 32, symmetric), atol=1e-5, rtol=0)
    assert qw.qweight.dtype == torch.uint8 and int(qw.qweight.max()) <= 2**bits - 1
    assert qw.scales.shape == (6, 2)


@pytest.mark.parametrize(("bits", "floor_db"), [(2, 3.0), (3, 10.0), (4, 16.0), (8, 40.0)])
def test_sqnr_bounds_per_bit_width(bits, floor_db):
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    for group in (-1, 32, 64, 128):
        approx = quantize_weight_rtn(w, QuantScheme(bits, group, True)).dequantize()
        assert sqnr_db(w, approx) > floor_db, (bits, group)


def test_smaller_groups_are_more_accurate():
    w = torch.randn(128, 512, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 3, 512)
    errors = [sqnr_db(w, quantize_weight_rtn(w, QuantScheme(4, g, True)).dequantize()) for g in (-1, 128, 32)]
    assert errors[0] < errors[1] < errors[2]


def test_zero_group_and_bad_group_size():
    w = torch.zeros(2, 64)
    assert torch.equal(quantize_weight_rtn(w, QuantScheme(4, 32, False)).dequantize(), w)
    scale, zero = compute_qparams(w.view(2, 2, 32), QuantScheme(4, 32, True))
    assert torch.all(scale > 0) and torch.all(zero == 8)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_weight_rtn(torch.randn(2, 96), QuantScheme(4, 64, True))
