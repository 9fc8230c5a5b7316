"""FP8 E4M3: weight/activation grids, the simulated product against torch's FP8 kernel, the stage."""

from __future__ import annotations

import pydantic
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from lmpress.errors import LmpressInputError
from lmpress.quantize.fp8 import FP8Config, run_fp8
from lmpress.registry import StageContext
from lmpress.weights.float8 import FP8_MAX, Fp8Linear, fp8_layers, quantize_fp8, quantize_fp8_per_token
from lmpress.weights.int8_linear import sqnr_db


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_weight_scales_map_the_range_to_448(strategy):
    w = torch.randn(16, 32) * torch.arange(1, 17)[:, None]
    codes, scale = quantize_fp8(w, strategy)
    assert codes.dtype == torch.float8_e4m3fn
    assert scale.shape == ((16, 1) if strategy == "channel" else (1,))
    amax = codes.float().abs().amax(dim=1)
    if strategy == "channel":
        assert torch.equal(amax, torch.full((16,), FP8_MAX))
    else:
        assert amax.max() == FP8_MAX and amax.min() < FP8_MAX / 4
    divisor = scale if strategy == "channel" else scale[0]
    assert sqnr_db(w, codes.float() * divisor) > 25  # E4M3's 3 mantissa bits: ~30 dB


def test_per_token_activation_scales():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    codes, scale = quantize_fp8_per_token(x)
    assert torch.allclose(scale[:, 0], torch.tensor([2.0 / FP8_MAX, 1.0]))
    assert codes.float()[0, 1] == -FP8_MAX and torch.equal(codes.float()[1], torch.zeros(3))


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_simulated_product_equals_torch_fp8_kernel(strategy):
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    x = torch.randn(3, 7, 64, generator=g)
    module = Fp8Linear.from_linear(linear, strategy)
    y = module(x)
    codes, x_scale = quantize_fp8_per_token(x.reshape(-1, 64))
    w_scale = module.weight_scale.reshape(1, -1).expand(1, 96).contiguous()
    kernel = torch._scaled_mm(codes, module.weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.float32)
    with torch.no_grad():
        reference = linear(x)
    assert sqnr_db(kernel + linear.bias.detach(), y.reshape(-1, 96)) > 100
    assert 20 < sqnr_db(reference, y) < 40


def test_stage_replaces_every_linear_but_the_head(tiny_llama_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    ids = torch.tensor([[1, 5, 9, 200, 33, 7]])
    with torch.no_grad():
        reference = model(ids).logits
    ctx = StageContext(calibration=lambda: None, state_dir=tmp_path, resume=False, fingerprint="x")
    summary = run_fp8(model, FP8Config(weights="tensor"), ctx)
    assert summary["quantized_layers"] == 14 and len(fp8_layers(model)) == 14
    assert isinstance(model.lm_head, torch.nn.Linear)
    with torch.no_grad():
        logits = model(ids).logits
    assert sqnr_db(reference, logits) > 15


def test_missing_float8_is_an_input_error(monkeypatch, tiny_llama_dir):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(LmpressInputError, match="no float8 dtypes"):
        FP8Config().check(None)


def test_config_refuses_unknown_strategy():
    with pytest.raises(pydantic.ValidationError):
        FP8Config(weights="group")


def test_the_runtime_keeps_the_float32_values_the_layer_converts_at_each_call():
    """``Fp8Linear`` holds 1 byte per weight (no float copy after a forward); the runtime's simulated kernel keeps
    the E4M3 values in float32 once, whatever the runtime's dtype, and computes the layer's product bit for bit."""
    from lmpress.runtime.kernels import build_kernel, kernel_of

    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(nn.Linear(64, 32, bias=True), "channel")
    x = torch.randn(3, 64)
    layer(x)
    assert [name for name, value in vars(layer).items() if isinstance(value, torch.Tensor)] == []
    runtime = build_kernel("fp8-simulated", layer, torch.bfloat16)
    assert kernel_of(runtime) == "fp8-simulated" and torch.equal(runtime(x), layer(x))
    runtime, layer = runtime.to(torch.bfloat16), layer.to(torch.bfloat16)  # the bias follows, the weights do not
    assert runtime.values.dtype == torch.float32 and runtime.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(runtime.values, layer.weight.float())
    assert torch.equal(runtime(x), layer(x)) and torch.equal(runtime(x.bfloat16()), layer(x.bfloat16()))
    # chosen where an FP8 GPU cannot take the layer's shape (select.kernel_candidates): never _scaled_mm
    assert not runtime.multiplies_in_fp8(torch.device("cuda"))
