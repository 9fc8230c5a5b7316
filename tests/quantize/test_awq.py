"""AWQ: exact folding, scale and clip searches, and error below RTN."""

from __future__ import annotations

import math
from functools import cache

import pydantic
import pytest
import torch

from lmpress import quantize_model
from lmpress.anatomy import decoder_layers, get_anatomy
from lmpress.calib.engine import capture_first_layer_inputs, expand_groups
from lmpress.calib.session import LayerSession
from lmpress.data import calibration_samples, load_text, tokenize
from lmpress.loader import DTYPES, load_model
from lmpress.quantize.awq import AWQConfig, AWQMethod, run_awq
from lmpress.quantize.awq_search import apply_clip, fake_quantize_weight, fold_scales, search_clip
from lmpress.quantize.rtn import RTNConfig, run_rtn
from lmpress.registry import StageContext
from lmpress.weights.kquant import kquant_grid
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn


def calibration_for(tokenizer, n: int = 8, seq_len: int = 32) -> torch.Tensor:
    return calibration_samples(tokenize(tokenizer, load_text("builtin:python-docs")), n, seq_len, seed=0)


def with_salient_channels(model) -> None:
    """A few input channels with large activations, as real LLMs have (random tiny models do not)."""
    g = torch.Generator().manual_seed(3)
    for layer in decoder_layers(model):
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data[torch.randperm(128, generator=g)[:6]] *= 25


def layer0_session(model, calibration, config) -> LayerSession:
    inputs = capture_first_layer_inputs(model, calibration.split(4), device=torch.device("cpu"))
    layer = decoder_layers(model)[0]
    targets = {
        n: config.scheme_for(f"model.layers.0.{n}") for n, m in layer.named_modules() if hasattr(m, "in_features")
    }
    groups = expand_groups(get_anatomy(model), targets)
    return LayerSession(0, layer, "model.layers.0.", targets, groups, inputs, torch.device("cpu"), model=model)


@torch.no_grad()
def layer_outputs(session: LayerSession) -> torch.Tensor:
    """In float32: the engine's own outputs are stored in float16."""
    return torch.cat([session.layer(hidden, **kwargs) for hidden, kwargs in session.batches()])


def context(tmp_path, calibration) -> StageContext:
    return StageContext(calibration=lambda: calibration, state_dir=tmp_path / "s", resume=False, fingerprint="f")


def test_fold_scales_keeps_the_float_function(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir))
    model = loaded.model
    config = AWQConfig(bits=4, group_size=32)
    session = layer0_session(model, calibration_for(loaded.tokenizer), config)
    before = layer_outputs(session)
    layer = session.layer
    g = torch.Generator().manual_seed(0)
    s1, s2 = torch.rand(128, generator=g) * 4 + 0.1, torch.rand(256, generator=g) * 4 + 0.1
    fold_scales(layer.input_layernorm, [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], s1)
    fold_scales(layer.mlp.up_proj, [layer.mlp.down_proj], s2)
    torch.testing.assert_close(layer_outputs(session), before, rtol=1e-5, atol=1e-5)


def test_awq_search_leaves_the_float_function_unchanged(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir))
    model = loaded.model
    with_salient_channels(model)
    config = AWQConfig(bits=4, group_size=32, clip=False)
    session = layer0_session(model, calibration_for(loaded.tokenizer), config)
    before = layer_outputs(session)
    norm_before = session.layer.input_layernorm.weight.detach().clone()
    method = AWQMethod(config)
    method.scale_and_clip(session)
    assert not torch.equal(session.layer.input_layernorm.weight, norm_before)  # scales were folded
    assert max(method.alphas) > 0
    assert method.skipped_pairs == {"self_attn.v_proj -> self_attn.o_proj"}  # GQA: 64 values, 128 o_proj inputs
    torch.testing.assert_close(layer_outputs(session), before, rtol=1e-5, atol=1e-5)


def test_clip_search_never_loses_to_no_clipping():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    w[:, 3] *= 6
    x = torch.randn(256, 64, generator=g)
    scheme = QuantScheme(3, 32, True)
    shrink = search_clip(w, x, scheme)
    linear = torch.nn.Linear(64, 48, bias=False)
    linear.weight.data = w.clone()
    apply_clip(linear, shrink, scheme)
    clipped = quantize_weight_rtn(linear.weight.data, scheme).dequantize()
    plain = quantize_weight_rtn(w, scheme).dequantize()
    err = lambda q: ((x @ (w - q).T) ** 2).mean().item()  # noqa: E731
    assert (shrink < 1).any()
    assert err(clipped) < err(plain)


def test_clipping_writes_into_the_weight_the_layer_already_holds():
    # The engine gives back the pages of the (memory-mapped) weight tensor a linear holds when it is
    # quantized; a clip that swapped in a new tensor would leave the original resident.
    linear = torch.nn.Linear(64, 48, bias=False)
    weight = linear.weight.data
    apply_clip(linear, torch.full((48, 2), 0.5), QuantScheme(4, 32, True))
    assert linear.weight.data.data_ptr() == weight.data_ptr()
    assert weight.abs().amax() < 0.5 * 1 / 8 + 1e-6  # nn.Linear's init bound is 1/sqrt(64)


@pytest.mark.parametrize("rounding", ["rtn", "gptq"])
def test_awq_error_is_below_rtn(tiny_llama_dir, tmp_path, rounding):
    loaded = load_model(str(tiny_llama_dir))
    calibration = calibration_for(loaded.tokenizer, n=16)

    def quantized_nll(run, config):
        model = load_model(str(tiny_llama_dir)).model
        with_salient_channels(model)
        summary = run(model, config, context(tmp_path / config.method, calibration))
        with torch.no_grad():
            reference = load_model(str(tiny_llama_dir)).model
            with_salient_channels(reference)
            target = torch.softmax(reference(calibration).logits, -1)
            logits = model(calibration).logits
        return torch.nn.functional.kl_div(torch.log_softmax(logits, -1), target, reduction="batchmean").item(), summary

    rtn_kl, _ = quantized_nll(run_rtn, RTNConfig(bits=3, group_size=32))
    awq_kl, summary = quantized_nll(run_awq, AWQConfig(bits=3, group_size=32, rounding=rounding, search_samples=16))
    assert summary["quantized_linears"] == 14
    assert awq_kl < 0.8 * rtn_kl, (awq_kl, rtn_kl)


def test_gptq_keys_need_gptq_rounding():
    with pytest.raises(pydantic.ValidationError, match="act_order only apply with rounding: gptq"):
        AWQConfig(act_order=True)
    assert AWQConfig(act_order=True, rounding="gptq").act_order


@cache
def awq_kl_to_float(model_dir, dtype: str, method: str = "awq") -> float:
    """KL(float32 model || model quantized in ``dtype``) on calibration text; salient channels as in real LLMs."""
    loaded = load_model(str(model_dir), dtype)
    with_salient_channels(loaded.model)
    settings = {"bits": 3, "group_size": 32} | ({"search_samples": 8} if method == "awq" else {})
    quantize_model(loaded.model, loaded.tokenizer, method=method, data={"samples": 8, "seq_len": 32}, **settings)
    assert all(p.dtype == DTYPES[dtype] for p in loaded.model.parameters() if p.is_floating_point())
    reference = load_model(str(model_dir)).model
    with_salient_channels(reference)
    tokens = calibration_for(loaded.tokenizer, n=8)
    with torch.no_grad():
        target = torch.log_softmax(reference(tokens).logits, -1)
        logits = loaded.model.float()(tokens).logits
    return torch.nn.functional.kl_div(
        torch.log_softmax(logits, -1), target, reduction="batchmean", log_target=True
    ).item()


@pytest.mark.long
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_awq_works_on_half_precision_models(tiny_llama_dir, dtype):
    """The searches record float32 inputs; a bfloat16/float16 block must still run on them, to the same quality."""
    half = awq_kl_to_float(tiny_llama_dir, dtype)
    full = awq_kl_to_float(tiny_llama_dir, "float32")
    rtn = awq_kl_to_float(tiny_llama_dir, "float32", method="rtn")
    assert math.isfinite(half) and half < 1.25 * full and half < 0.8 * rtn, (half, full, rtn)


def test_awq_scale_search_rounds_as_rtn_does_with_kquant_scales():
    w = torch.randn(16, 512, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.01, 1, 512)
    scheme = QuantScheme(4, 32, True, k_quant_scales=True)
    assert torch.equal(fake_quantize_weight(w, scheme), quantize_weight_rtn(w, scheme).dequantize())


@pytest.mark.long
@pytest.mark.parametrize(
    "settings", [{"rounding": "rtn"}, {"rounding": "gptq", "act_order": True, "static_groups": True, "mse": True}]
)
def test_awq_with_kquant_scales_leaves_every_layer_on_the_grid(tiny_llama_wide_dir, tmp_path, settings):
    loaded = load_model(str(tiny_llama_wide_dir))
    config = AWQConfig(bits=4, group_size=32, k_quant_scales=True, search_samples=8, **settings)
    summary = run_awq(loaded.model, config, context(tmp_path, calibration_for(loaded.tokenizer)))
    assert summary["quantized_linears"] == 14
    for name, module in loaded.model.named_modules():
        if isinstance(module, QuantizedLinear):
            assert module.scheme.k_quant_scales, name
            assert torch.equal(module.scales.half().float(), module.scales.float()), name
            assert kquant_grid(module.scales.half()) is not None, name
