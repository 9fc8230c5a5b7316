"""GPTQ checkpoints: lmpress round trip, an independent reader written from the format, transformers' config."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from lmpress.errors import LmpressInputError
from lmpress.export.formats import load_quantized_checkpoint, load_quantized_model, quantized_layers
from lmpress.weights.apply import apply_quantized_weight
from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn
from tests.weights.test_qlinear import act_order_weight


def expected_layers(model):
    """The model's quantized weights as GPTQ stores them: float16 scales."""
    layers = {}
    for name, module in quantized_layers(model).items():
        qw = module.unpack()
        qw.scales = qw.scales.half()
        layers[name] = qw
    return layers


def independent_dequantize(path, name, bits, group_size, v1=True) -> np.ndarray:
    """GPTQ dequantization from the file, by the format's definition, in numpy.

    Code i of a column is bits [i*bits, (i+1)*bits) of the column's little-endian
    bit stream over qweight's rows; qzeros streams along the output axis; v1
    stores zero - 1; g_idx gives each input column's group.
    """
    tensors = load_file(path / "model.safetensors")
    words_w = tensors[f"{name}.qweight"].astype(np.int64) & 0xFFFFFFFF  # (in*bits/32, out)
    words_z = tensors[f"{name}.qzeros"].astype(np.int64) & 0xFFFFFFFF  # (groups, out*bits/32)
    scales = tensors[f"{name}.scales"].astype(np.float32)  # (groups, out)
    g_idx = tensors[f"{name}.g_idx"].astype(np.int64)
    in_features, out_features = words_w.shape[0] * 32 // bits, scales.shape[1]

    def stream(words, index):  # code `index` of a stream of 32-bit words (last axis)
        start = index * bits
        lo, hi = start // 32, (start + bits - 1) // 32
        value = words[..., lo] >> (start % 32)
        if hi != lo:
            value |= words[..., hi] << (32 - start % 32)
        return value & (2**bits - 1)

    q = np.stack([stream(words_w.T, i) for i in range(in_features)], axis=1)  # (out, in)
    z = np.stack([stream(words_z, o) for o in range(out_features)], axis=1)  # (groups, out)
    if v1:
        z = z + 1
    return ((q - z[g_idx].T).astype(np.float32) * scales[g_idx].T).astype(np.float32)


@pytest.mark.parametrize(
    "bits,group_size,symmetric",
    [(4, 32, False), (4, 64, True), (3, 32, True), (3, -1, False), (2, 64, False), (8, -1, True)],
)
def test_round_trip_and_independent_reader(quantized_tiny, export, bits, group_size, symmetric):
    model, tokenizer = quantized_tiny(bits=bits, group_size=group_size, symmetric=symmetric)
    out = export("gptq", model, tokenizer)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    v1 = config["checkpoint_format"] == "gptq"
    assert (config["bits"], config["group_size"], config["sym"]) == (bits, group_size, symmetric)
    back = load_quantized_checkpoint(out)
    expected = expected_layers(model)
    assert set(back) == set(expected) and "lm_head" not in back
    for name, qw in expected.items():
        assert torch.equal(back[name].qweight, qw.qweight), name
        assert torch.equal(back[name].zeros, qw.zeros), name
        assert torch.equal(back[name].scales, qw.scales), name
        assert back[name].scheme == qw.scheme
        dense = qw.dequantize()
        assert torch.equal(back[name].dequantize(), dense), name
        assert np.array_equal(independent_dequantize(out, name, bits, group_size, v1), dense.numpy()), name


def test_config_is_accepted_by_transformers_and_has_gptq_keys(quantized_tiny, export):
    from transformers import GPTQConfig

    model, tokenizer = quantized_tiny(bits=4, group_size=64, symmetric=True)
    out = export("gptq", model, tokenizer)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    for key, value in {"quant_method": "gptq", "desc_act": False, "checkpoint_format": "gptq"}.items():
        assert qc[key] == value
    assert qc["true_sequential"] is True and "dynamic" not in qc
    parsed = GPTQConfig.from_dict(qc)
    assert (parsed.bits, parsed.group_size, parsed.sym, parsed.desc_act) == (4, 64, True, False)
    tensors = load_file(out / "model.safetensors")
    assert "model.embed_tokens.weight" in tensors and "model.norm.weight" in tensors
    assert "model.layers.0.self_attn.q_proj.weight" not in tensors
    assert tensors["model.layers.0.self_attn.q_proj.scales"].dtype == np.float16
    assert (out / "tokenizer.json").is_file()


def test_mixed_schemes_become_dynamic_overrides(quantized_tiny, export):
    from transformers import GPTQConfig

    model, tokenizer = quantized_tiny(
        bits=4, group_size=32, ignore=["lm_head", r".*layers\.1\.mlp\.up_proj"], overrides={r".*down_proj": {"bits": 8}}
    )
    out = export("gptq", model, tokenizer)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["bits"] == 4
    assert qc["dynamic"][r"+:^model\.layers\.0\.mlp\.down_proj$"]["bits"] == 8
    assert qc["dynamic"][r"-:^model\.layers\.1\.mlp\.up_proj$"] == {}
    GPTQConfig.from_dict(qc)
    back = load_quantized_checkpoint(out)
    assert back["model.layers.1.mlp.down_proj"].scheme.bits == 8
    assert back["model.layers.0.mlp.up_proj"].scheme.bits == 4
    assert "model.layers.1.mlp.up_proj" not in back
    for name, qw in expected_layers(model).items():
        assert torch.equal(back[name].dequantize(), qw.dequantize()), name


def test_act_order_writes_g_idx_and_desc_act(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32)
    for i, (name, module) in enumerate(quantized_layers(model).items()):
        apply_quantized_weight(model, name, act_order_weight(module.dequantized_weight(), QuantScheme(4, 32, True), i))
    out = export("gptq", model, tokenizer)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["desc_act"] is True
    back = load_quantized_checkpoint(out)
    for name, qw in expected_layers(model).items():
        assert torch.equal(back[name].g_idx, qw.g_idx)
        dense = qw.dequantize()
        assert torch.equal(back[name].dequantize(), dense)
        assert np.array_equal(independent_dequantize(out, name, 4, 32), dense.numpy())


def test_zero_point_of_zero_is_written_as_v2(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32, symmetric=False)
    name, module = next(iter(quantized_layers(model).items()))
    qw = module.unpack()
    qw.zeros[0, 0] = 0.0
    apply_quantized_weight(model, name, qw)
    out = export("gptq", model, tokenizer)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["checkpoint_format"] == "gptq_v2"
    assert load_quantized_checkpoint(out)[name].zeros[0, 0] == 0
    assert np.array_equal(
        independent_dequantize(out, name, 4, 32, v1=False), expected_layers(model)[name].dequantize().numpy()
    )


def test_loaded_model_predicts_like_the_quantized_model(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32)
    out = export("gptq", model, tokenizer)
    loaded = load_quantized_model(out)
    assert set(quantized_layers(loaded)) == set(quantized_layers(model))
    ids = torch.tensor([[1, 7, 42, 99, 3, 250]])
    with torch.no_grad():
        ours, theirs = model(ids).logits, loaded(ids).logits
    assert torch.allclose(ours, theirs, atol=2e-3)  # only the scales' float16 rounding differs


def test_writer_refuses_unquantized_models_and_widths_it_cannot_pack(tiny_llama_dir, export):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    dense = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with pytest.raises(LmpressInputError, match="no quantized layers"):
        export("gptq", dense, tokenizer)
    # 3-bit codes of an 80-wide input fill 7.5 words: GPTQ's qweight cannot hold them.
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=80,
        intermediate_size=160,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = AutoModelForCausalLM.from_config(config)
    q_proj = model.model.layers[0].self_attn.q_proj
    apply_quantized_weight(
        model, "model.layers.0.self_attn.q_proj", quantize_weight_rtn(q_proj.weight.data, QuantScheme(3, -1, True))
    )
    with pytest.raises(LmpressInputError, match=r"in_features 80, which 3-bit GPTQ cannot pack"):
        export("gptq", model, tokenizer)
