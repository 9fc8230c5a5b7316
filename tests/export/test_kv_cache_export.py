"""A calibrated FP8 KV cache in a compressed-tensors export: ``kv_cache_scheme`` and each attention's ``k_scale`` /
``v_scale`` as compressed-tensors' own code lays them out, read back by lmpress's loader and its runtime; INT8
(per token, dynamic) writes nothing."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from lmpress.evals.agreement_matrix import build_candidate, scheme_named
from lmpress.export.formats import load_quantized_model
from lmpress.quantize.kv_attention import attach_kv_quant, calibrate_kv_scales, kv_quant_of
from lmpress.registry import exporter
from lmpress.runtime.checkpoint import load_checkpoint
from lmpress.weights.kv_quant import KVScheme
from tests.quantize.test_awq import calibration_for


@pytest.fixture(scope="module")
def candidate(tiny_llama_wide_dir, tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_wide_dir)
    calibration = calibration_for(tokenizer)
    root = tmp_path_factory.mktemp("kv-export")
    model = build_candidate(tiny_llama_wide_dir, scheme_named("W4 g32 sym"), calibration, root / "state")
    return model, tokenizer, calibration


def export_with(candidate, scheme: KVScheme, out):
    model, tokenizer, calibration = candidate
    kv = calibrate_kv_scales(model, calibration, scheme)
    attach_kv_quant(model, kv)
    try:
        exporter("compressed-tensors")(model, tokenizer, out)
    finally:
        attach_kv_quant(model, None)
    return kv


@pytest.mark.parametrize(("scales", "strategy"), [("tensor", "tensor"), ("head", "attn_head")])
def test_fp8_kv_scales_are_written_where_compressed_tensors_puts_them(candidate, tmp_path, scales, strategy):
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams
    from safetensors.torch import load_file

    kv = export_with(candidate, KVScheme("fp8", scales), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == strategy and qc["kv_cache_scheme"]["type"] == "float"
    # compressed-tensors' own initialization of that scheme (initialize_qparams, as it runs for each attention
    # module, kv_observed_shape = (kv_heads, None, head_dim)) gives k_scale / v_scale shapes: ours have them.
    # (Its apply_quantization_config finds no attention here: it looks for a past_key_values argument, which
    # transformers 5 renamed to cache.)
    args = QuantizationConfig.model_validate(qc).kv_cache_scheme
    hf_config = candidate[0].config
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    holder = torch.nn.Module()
    for base in ("k", "v"):
        initialize_qparams(holder, base, args, (hf_config.num_key_value_heads, None, head_dim), torch.float32, False)
    tensors = load_file(tmp_path / "model.safetensors")
    scales = {k: v.shape for k, v in tensors.items() if k.endswith(("k_scale", "v_scale"))}
    assert len(scales) == 2 * config["num_hidden_layers"]
    assert set(scales.values()) == {holder.k_scale.shape} == {holder.v_scale.shape}
    layer0 = tensors["model.layers.0.self_attn.k_scale"].float().reshape(-1)
    torch.testing.assert_close(layer0, kv.k_scales[0].reshape(-1))


@pytest.mark.parametrize("scales", ["tensor", "head"])
def test_lmpress_reads_the_cache_back_in_its_loader_and_runtime(candidate, tmp_path, scales):
    kv = export_with(candidate, KVScheme("fp8", scales), tmp_path)
    for read in (kv_quant_of(load_quantized_model(tmp_path)), load_checkpoint(tmp_path).kv_quant):
        assert read is not None and read.scheme == kv.scheme
        for ours, back in zip(kv.k_scales + kv.v_scales, read.k_scales + read.v_scales, strict=True):
            torch.testing.assert_close(back, ours.reshape(-1))


def test_an_int8_cache_writes_no_kv_cache_scheme(candidate, tmp_path):
    export_with(candidate, KVScheme("int8", "token"), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] is None
    assert load_checkpoint(tmp_path).kv_quant is None


def test_a_corrupted_kv_scale_is_refused_in_one_line(candidate, tmp_path):
    from safetensors.torch import load_file, save_file

    from lmpress.errors import LmpressInputError

    export_with(candidate, KVScheme("fp8", "tensor"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor([float("nan")])
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LmpressInputError, match=r"model.layers.1.self_attn.v_scale: KV scales must be finite"):
        load_checkpoint(tmp_path)


def test_inspect_names_the_cache_and_its_bytes_per_token(candidate, tmp_path):
    from lmpress.export.inspect import inspect_artifact

    export_with(candidate, KVScheme("fp8", "head"), tmp_path)
    info = inspect_artifact(tmp_path)
    assert info["kv_cache"].startswith("FP8 KV, static per head, calibrated: ")
    assert "(0.50x bf16)" in info["kv_cache"]


def test_runtime_check_on_an_fp8_cache_allows_a_code_step_only_where_the_roundings_differ(candidate, tmp_path):
    """The run's runtime check reads an FP8 cache's export with int8 activations: keys a rounding apart take
    neighbouring E4M3 codes there, so the check's unit is the cache's step (2**-4), not int8's; two float32
    executions of one cache keep the float32 unit. The check still passes on what the runtime runs."""
    from lmpress.evals.agreement import (
        FLOAT32_UNIT,
        FP8_ACTIVATION_UNIT,
        INT8_ACTIVATION_UNIT,
        check_runtime_agreement,
        kv_cache_unit,
    )

    kv = export_with(candidate, KVScheme("fp8", "tensor"), tmp_path)
    evaluator = load_quantized_model(tmp_path)
    window = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5, 60, 61, 8, 9, 200, 4, 33, 71]])
    check = check_runtime_agreement("compressed-tensors", tmp_path, evaluator, window, kv=kv)
    assert check.passed, check.as_dict()
    assert check.unit == FP8_ACTIVATION_UNIT
    assert kv_cache_unit(kv, INT8_ACTIVATION_UNIT) == FP8_ACTIVATION_UNIT
    assert kv_cache_unit(kv, FLOAT32_UNIT) == FLOAT32_UNIT
    assert kv_cache_unit(None, INT8_ACTIVATION_UNIT) == FLOAT32_UNIT
