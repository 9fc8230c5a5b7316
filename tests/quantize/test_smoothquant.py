"""SmoothQuant: Eq. 4 factors, exact folding, W8A8 layers, and the smoothing gain on outlier channels."""

from __future__ import annotations

import pydantic
import pytest
import torch

from lmpress.loader import load_model
from lmpress.quantize.smoothquant import SmoothQuantConfig, SmoothQuantMethod, run_smoothquant, smoothing_factors
from lmpress.weights.float8 import fp8_layers
from lmpress.weights.qlinear import QuantizedLinear
from tests.quantize.test_awq import calibration_for, context, layer0_session, layer_outputs, with_salient_channels


def test_smoothing_factors_eq4():
    x_max = torch.tensor([4.0, 1.0, 0.0])
    w_max = torch.tensor([1.0, 4.0, 2.0])
    s = smoothing_factors(x_max, w_max, 0.5)
    assert torch.allclose(s[:2], torch.tensor([2.0, 0.5]))
    assert s[2] > 0  # a channel that never fires still gets a positive factor
    assert torch.allclose(smoothing_factors(x_max, w_max, 1.0)[:2], x_max[:2])


def test_smoothing_keeps_the_float_function(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir))
    model = loaded.model
    with_salient_channels(model)
    config = SmoothQuantConfig(alpha=0.8)
    session = layer0_session(model, calibration_for(loaded.tokenizer), config)
    before = layer_outputs(session)
    norm_before = model.model.layers[0].input_layernorm.weight.detach().clone()
    method = SmoothQuantMethod(config)
    method.smooth_layer(session)
    after = layer_outputs(session)
    assert method.smoothed == 3  # input_layernorm -> qkv, post_attention_layernorm -> gate/up, up -> down
    assert method.skipped_pairs == {"self_attn.v_proj -> self_attn.o_proj"}  # GQA: 64 values feed 128 inputs
    assert not torch.allclose(norm_before, model.model.layers[0].input_layernorm.weight)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def w8a8_logit_error(tiny_llama_dir, tmp_path, **settings) -> tuple[float, dict]:
    """Mean squared logit error of the tiny model after the stage; every linear but the head must be W8A8."""
    loaded = load_model(str(tiny_llama_dir))
    model = loaded.model
    with_salient_channels(model)
    calibration = calibration_for(loaded.tokenizer)
    with torch.no_grad():
        reference = model(calibration).logits
    summary = run_smoothquant(model, SmoothQuantConfig(**settings), context(tmp_path, calibration))
    if settings.get("activations") == "fp8":
        assert len(fp8_layers(model)) == 14  # 7 linears x 2 layers; lm_head ignored
    else:
        quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
        assert len(quantized) == 14
        assert all(m.kernel_name() == "w8a8" for m in quantized.values())
    with torch.no_grad():
        logits = model(calibration).logits
    return torch.mean((logits - reference) ** 2).item(), summary


def test_smoothing_lowers_the_w8a8_error(tiny_llama_dir, tmp_path):
    plain, summary = w8a8_logit_error(tiny_llama_dir, tmp_path / "a", smooth=False)
    assert summary["smoothed_pairs"] == 0
    smoothed, summary = w8a8_logit_error(tiny_llama_dir, tmp_path / "b", alpha=0.5)
    assert summary["smoothed_pairs"] == 6 and summary["mean_alpha"] == 0.5
    assert smoothed < 0.7 * plain


def test_alpha_search_and_gptq_rounding(tiny_llama_dir, tmp_path):
    fixed, _ = w8a8_logit_error(tiny_llama_dir, tmp_path / "a", alpha=0.5)
    searched, summary = w8a8_logit_error(
        tiny_llama_dir, tmp_path / "b", alpha_search=True, alpha_grid=4, rounding="gptq"
    )
    assert 0 <= summary["mean_alpha"] <= 1
    assert searched < 1.2 * fixed


def test_fp8_smoothing_and_gptq_lower_the_error(tiny_llama_dir, tmp_path):
    """activations: fp8 is FP8 W8A8 (E4M3 weights, per-token E4M3 activations); smoothing the salient channels and
    GPTQ rounding onto the E4M3 grid each lower the logit error of plain E4M3 round-to-nearest."""
    plain, _ = w8a8_logit_error(tiny_llama_dir, tmp_path / "a", activations="fp8", smooth=False)
    smoothed, summary = w8a8_logit_error(tiny_llama_dir, tmp_path / "b", activations="fp8", alpha=0.5)
    assert summary["smoothed_pairs"] == 6
    gptq, _ = w8a8_logit_error(tiny_llama_dir, tmp_path / "c", activations="fp8", smooth=False, rounding="gptq")
    assert smoothed < plain and gptq < plain, (plain, smoothed, gptq)


def test_resume_restores_the_fp8_layers(tiny_llama_dir, tmp_path):
    loaded = load_model(str(tiny_llama_dir))
    calibration = calibration_for(loaded.tokenizer)
    config = SmoothQuantConfig(activations="fp8", rounding="gptq")
    run_smoothquant(loaded.model, config, context(tmp_path, calibration))
    fresh = load_model(str(tiny_llama_dir)).model
    resumed_ctx = context(tmp_path, calibration)
    resumed_ctx.resume = True
    assert run_smoothquant(fresh, config, resumed_ctx)["resumed_at_layer"] == 2
    assert len(fp8_layers(fresh)) == 14
    with torch.no_grad():
        assert torch.equal(fresh(calibration).logits, loaded.model(calibration).logits)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"group_size": 64}, "per-channel weight scales"),
        ({"bits": 4}, "8"),
        ({"symmetric": False}, "symmetric"),
        ({"damp_percent": 0.1}, "rounding: gptq"),
        ({"smooth": False, "alpha": 0.3}, "smooth: true"),
        ({"alpha_search": True, "alpha": 0.3}, "not both"),
        ({"overrides": {".*down_proj": {"bits": 4}}}, "overrides"),
        ({"activations": "fp8", "rounding": "gptq", "mse": True}, "E4M3|FP8"),
        ({"activations": "int4"}, "int8"),
    ],
)
def test_config_refuses(settings, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        SmoothQuantConfig(**settings)


def test_scheme_carries_the_activations():
    scheme = SmoothQuantConfig().scheme_for("model.layers.0.mlp.down_proj")
    assert (scheme.bits, scheme.group_size, scheme.symmetric, scheme.activations) == (8, -1, True, "int8")
    assert SmoothQuantConfig().scheme_for("lm_head") is None


def test_resume_restores_the_w8a8_layers(tiny_llama_dir, tmp_path):
    """A resumed run restores finished layers from the stage state with their activation scheme."""
    loaded = load_model(str(tiny_llama_dir))
    calibration = calibration_for(loaded.tokenizer)
    run_smoothquant(loaded.model, SmoothQuantConfig(), context(tmp_path, calibration))
    fresh = load_model(str(tiny_llama_dir)).model
    resumed_ctx = context(tmp_path, calibration)
    resumed_ctx.resume = True
    summary = run_smoothquant(fresh, SmoothQuantConfig(), resumed_ctx)
    assert summary["resumed_at_layer"] == 2 and summary["smoothed_pairs"] == 0  # nothing recomputed
    layers = {n: m for n, m in fresh.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(layers) == 14 and {m.scheme.activations for m in layers.values()} == {"int8"}
    with torch.no_grad():
        assert torch.equal(fresh(calibration).logits, loaded.model(calibration).logits)
