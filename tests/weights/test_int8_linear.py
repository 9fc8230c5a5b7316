"""W8A8 execution: per-token int8 activations and torch._int_mm against a float reference."""

from __future__ import annotations

import pytest
import torch

from lmpress.weights.int8_linear import (
    fake_quantize_per_token,
    int8_matmul,
    int8_weight,
    quantize_per_token,
    sqnr_db,
    w8a8_linear,
    w8a8_reference,
)
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

W8A8 = QuantScheme(8, -1, True, "int8")


def test_per_token_codes_and_scales():
    x = torch.tensor([[0.5, -1.27, 0.0], [0.0, 0.0, 0.0]])
    codes, scale = quantize_per_token(x)
    assert codes.dtype == torch.int8
    assert torch.allclose(scale[:, 0], torch.tensor([0.01, 1.0]))
    assert codes[0].tolist() == [50, -127, 0]
    assert codes[1].tolist() == [0, 0, 0]
    assert torch.allclose(fake_quantize_per_token(x), codes.float() * scale)


@pytest.mark.parametrize("shape", [(1, 64, 96), (7, 40, 24), (33, 576, 1536)])
def test_int8_matmul_is_exact(shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    got = int8_matmul(a, b.t())
    assert got.dtype == torch.int32
    assert torch.equal(got.long(), a.long() @ b.long().t())


def test_int8_matmul_refuses_float():
    with pytest.raises(TypeError):
        int8_matmul(torch.zeros(4, 8), torch.zeros(8, 8, dtype=torch.int8))


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_w8a8_linear_matches_float_reference(rows):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g)
    bias = torch.randn(96, generator=g)
    x = torch.randn(rows, 64, generator=g)
    qw = quantize_weight_rtn(w, W8A8)
    weight = int8_weight(qw.qweight)
    scale = qw.scales[:, 0]
    y = w8a8_linear(x, weight.t().contiguous(), scale, bias)
    reference = w8a8_reference(x, weight, scale, bias)
    # the int32 accumulation is exact: only float32 rounding of the rescaling separates the two
    assert sqnr_db(reference, y) > 100
    # and both are within int8 quantization noise of the float layer
    assert 30 < sqnr_db(x @ w.T + bias, y) < 60


def test_quantized_linear_runs_w8a8_with_int8_matmul(monkeypatch):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 32, generator=g)
    x = torch.randn(2, 9, 32, generator=g)
    x[..., 3] *= 50  # an outlier channel: per-token quantization now costs much more than weight-only
    module = QuantizedLinear.from_quantized_weight(quantize_weight_rtn(w, W8A8), torch.zeros(48))
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape) or real(a, b))
    y = module(x)
    assert calls == [torch.Size([18, 32])]
    assert module.kernel_name() == "w8a8"
    module.kernel = "reference"
    simulated = module(x)
    assert sqnr_db(simulated, y) > 100
    weight_only = x @ module.dequantized_weight().T
    assert not torch.allclose(weight_only, y, atol=1e-4)  # the activations really were quantized


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_cpu_w8a8_runs_lmpress_int8_kernel_with_int_mm_s_bits(monkeypatch, dtype):
    """Where lmpress's CPU kernels build, an evaluated W8A8 layer runs its int8 kernel (torch._int_mm took 2 minutes
    a SmolLM2 window on an AVX2-only CPU): the same int32 sums, so the same bits as the _int_mm path."""
    from lmpress.runtime.kernels import cpu_int

    if not cpu_int.available():
        pytest.skip("lmpress's C++ kernels do not build on this host")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 192, generator=g)
    x = (torch.randn(3, 5, 192, generator=g) * 30).to(dtype)
    module = QuantizedLinear.from_quantized_weight(quantize_weight_rtn(w, W8A8), torch.randn(40, generator=g))
    expected = w8a8_linear(x, int8_weight(module.codes()).t().contiguous(), module.scales[:, 0], module.bias)
    calls = []
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape))
    y = module(x)
    assert module._kernel_cache[0] == "w8a8-cpu" and not calls
    assert y.dtype == dtype and torch.equal(y, expected)


def test_only_per_channel_symmetric_8bit_weights_take_the_int8_matmul():
    """Other integer weights beside int8 activations (W8A8 in groups, W4A8) run the per-token simulation."""
    assert QuantizedLinear(64, 32, QuantScheme(8, -1, True, "int8")).int8_matmul_holds
    for scheme in (
        QuantScheme(8, 32, True, "int8"),
        QuantScheme(8, -1, False, "int8"),
        QuantScheme(4, 32, True, "int8"),
    ):
        assert not QuantizedLinear(64, 32, scheme).int8_matmul_holds
    with pytest.raises(ValueError, match="QuantizedLinear runs int8 or float activations, not fp8"):
        QuantizedLinear(64, 32, QuantScheme(8, -1, True, "fp8"))
