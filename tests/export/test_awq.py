"""AWQ GEMM checkpoints: lmpress round trip, an independent reader written from the format, bad input."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from lmpress.errors import LmpressInputError
from lmpress.export.formats import load_quantized_checkpoint, load_quantized_model, quantized_layers
from lmpress.weights.apply import apply_quantized_weight
from lmpress.weights.scheme import QuantScheme
from tests.weights.test_qlinear import act_order_weight

# Nibble i of an AWQ GEMM word holds output column AWQ_ORDER[i] of its 8 columns (AutoAWQ's pack order).
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def expected_layers(model):
    layers = {}
    for name, module in quantized_layers(model).items():
        qw = module.unpack()
        qw.scales = qw.scales.half()
        layers[name] = qw
    return layers


def awq_words_to_codes(words: np.ndarray) -> np.ndarray:
    """(rows, out/8) int32 words -> (rows, out) 4-bit codes, undoing the interleave."""
    words = words.astype(np.int64) & 0xFFFFFFFF
    codes = np.zeros((words.shape[0], words.shape[1] * 8), dtype=np.int64)
    for i, column in enumerate(AWQ_ORDER):
        codes[:, column::8] = (words >> (4 * i)) & 0xF
    return codes


def independent_dequantize(path, name, group_size) -> np.ndarray:
    tensors = load_file(path / "model.safetensors")
    q = awq_words_to_codes(tensors[f"{name}.qweight"])  # (in, out)
    z = awq_words_to_codes(tensors[f"{name}.qzeros"])  # (groups, out)
    s = tensors[f"{name}.scales"].astype(np.float32)  # (groups, out)
    group = np.arange(q.shape[0]) // group_size
    return ((q - z[group]).astype(np.float32) * s[group]).T


@pytest.mark.parametrize("group_size,symmetric", [(32, False), (64, True), (128, False)])
def test_round_trip_and_independent_reader(quantized_tiny, export, group_size, symmetric):
    model, tokenizer = quantized_tiny(bits=4, group_size=group_size, symmetric=symmetric)
    out = export("awq", model, tokenizer)
    back = load_quantized_checkpoint(out)
    expected = expected_layers(model)
    assert set(back) == set(expected)
    for name, qw in expected.items():
        assert torch.equal(back[name].qweight, qw.qweight), name
        assert torch.equal(back[name].zeros, qw.zeros), name
        assert torch.equal(back[name].scales, qw.scales), name
        dense = qw.dequantize()
        assert torch.equal(back[name].dequantize(), dense), name
        assert np.array_equal(independent_dequantize(out, name, group_size), dense.numpy()), name


def test_config_is_accepted_by_transformers(quantized_tiny, export):
    from transformers import AwqConfig

    model, tokenizer = quantized_tiny(bits=4, group_size=64, ignore=["lm_head", r".*layers\.0\.mlp\.down_proj"])
    out = export("awq", model, tokenizer)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == {
        "quant_method": "awq",
        "version": "gemm",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
        "modules_to_not_convert": ["model.layers.0.mlp.down_proj"],
    }
    parsed = AwqConfig.from_dict(qc)
    assert (parsed.bits, parsed.group_size, parsed.zero_point) == (4, 64, True)
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.qweight"].shape == (128, 16)
    assert tensors["model.layers.0.self_attn.q_proj.qzeros"].shape == (2, 16)
    assert tensors["model.layers.0.self_attn.q_proj.scales"].shape == (2, 128)
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == np.float32


def test_loaded_model_predicts_like_the_quantized_model(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32, symmetric=False)
    loaded = load_quantized_model(export("awq", model, tokenizer))
    ids = torch.tensor([[1, 7, 42, 99, 3, 250]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits, atol=2e-3)


@pytest.mark.parametrize(
    "rtn_config,message",
    [
        ({"bits": 8, "group_size": 32}, "8-bit weights; AWQ GEMM holds 4-bit weights only"),
        ({"bits": 3, "group_size": 32}, "3-bit weights; AWQ GEMM holds 4-bit weights only"),
        ({"bits": 4, "group_size": -1}, "per-channel scales"),
        ({"bits": 4, "group_size": 32, "overrides": {".*down_proj": {"group_size": 64}}}, "one group size per model"),
        ({"bits": 4, "group_size": 32, "ignore": []}, "lm_head is quantized"),
    ],
)
def test_what_awq_cannot_hold_is_a_clear_input_error(quantized_tiny, export, rtn_config, message):
    model, tokenizer = quantized_tiny(**rtn_config)
    with pytest.raises(LmpressInputError, match=message):
        export("awq", model, tokenizer)


def test_act_order_is_refused(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32)
    name, module = next(iter(quantized_layers(model).items()))
    apply_quantized_weight(model, name, act_order_weight(module.dequantized_weight(), QuantScheme(4, 32, True)))
    with pytest.raises(LmpressInputError, match="act-order"):
        export("awq", model, tokenizer)


@pytest.mark.parametrize("group_size,symmetric", [(32, False), (64, True)])
def test_compressed_tensors_awq_converter_reads_the_checkpoint(quantized_tiny, export, group_size, symmetric):
    """compressed-tensors' AutoAWQ GEMM converter (an installed AWQ reader), then its own decompressor."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from safetensors.torch import load_file as load_torch

    model, tokenizer = quantized_tiny(bits=4, group_size=group_size, symmetric=symmetric)
    out = export("awq", model, tokenizer)
    converter = AutoAWQConverter.from_autoawq_config(
        json.loads((out / "config.json").read_text())["quantization_config"]
    )
    converted = converter.process(load_torch(out / "model.safetensors"))
    scheme = converter.update_config(None).config_groups["config_group_0"]
    for name, qw in expected_layers(model).items():
        local = {k.removeprefix(name + "."): v for k, v in converted.items() if k.startswith(name + ".weight_")}
        codes = unpack_from_int32(local["weight_packed"], 4, local["weight_shape"]) + 8
        n_groups = qw.scales.shape[1]
        zeros = unpack_from_int32(local["weight_zero_point"], 4, (qw.qweight.shape[0], n_groups), packed_dim=0) + 8
        assert torch.equal(codes.to(torch.uint8), qw.qweight), name
        assert torch.equal(zeros.float(), qw.zeros), name
        assert torch.equal(local["weight_scale"], qw.scales), name
        # compressed-tensors dequantizes in the scales' dtype (float16), so compare at float16 precision
        weight = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        assert torch.allclose(weight.float(), qw.dequantize(), rtol=1e-3, atol=1e-4), name
