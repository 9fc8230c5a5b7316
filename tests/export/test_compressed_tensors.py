"""compressed-tensors pack-quantized checkpoints: round trip, and the compressed-tensors package as consumer."""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from lmpress.errors import LmpressInputError
from lmpress.export.formats import load_quantized_checkpoint, load_quantized_model, quantized_layers
from lmpress.weights.apply import apply_quantized_weight
from lmpress.weights.scheme import QuantScheme
from tests.weights.test_qlinear import act_order_weight

CASES = [(4, 32, True), (4, 64, False), (3, 32, False), (8, -1, False), (2, 64, True)]


def config_of(out):
    return json.loads((out / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("bits,group_size,symmetric", CASES)
def test_round_trip_is_exact(quantized_tiny, export, bits, group_size, symmetric):
    model, tokenizer = quantized_tiny(bits=bits, group_size=group_size, symmetric=symmetric)
    out = export("compressed-tensors", model, tokenizer)
    back = load_quantized_checkpoint(out)
    layers = quantized_layers(model)
    assert set(back) == set(layers)
    for name, module in layers.items():
        qw = module.unpack()
        assert torch.equal(back[name].qweight, qw.qweight), name
        assert torch.equal(back[name].scales, qw.scales), name
        assert torch.equal(back[name].zeros, qw.zeros), name
        assert back[name].scheme == qw.scheme
        assert torch.equal(back[name].dequantize(), module.dequantized_weight()), name
    loaded = load_quantized_model(out)
    ids = torch.tensor([[1, 7, 42, 99, 3, 250]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def _decompress_with_compressed_tensors(out) -> dict[str, torch.Tensor]:
    """Every quantized layer's weight as compressed-tensors' own pack-quantized decompressor computes it."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(
        {k: v for k, v in config_of(out).items() if k in QuantizationConfig.model_fields}
    )
    tensors = load_file(out / "model.safetensors")
    weights = {}
    for key in [k for k in tensors if k.endswith(".weight_packed")]:
        name = key.removesuffix(".weight_packed")
        groups = [g for g in qc.config_groups.values() if "Linear" in g.targets or name in g.targets]
        assert len(groups) == 1 and name not in qc.ignore
        local = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".weight_")}
        weights[name] = PackedQuantizationCompressor.decompress(local, groups[0])["weight"]
    return weights


@pytest.mark.parametrize("bits,group_size,symmetric", CASES)
def test_compressed_tensors_decompressor_gives_the_same_weights(quantized_tiny, export, bits, group_size, symmetric):
    pytest.importorskip("compressed_tensors")
    model, tokenizer = quantized_tiny(bits=bits, group_size=group_size, symmetric=symmetric)
    out = export("compressed-tensors", model, tokenizer)
    weights = _decompress_with_compressed_tensors(out)
    layers = quantized_layers(model)
    assert set(weights) == set(layers)
    for name, module in layers.items():
        assert torch.equal(weights[name], module.dequantized_weight()), name


def test_mixed_schemes_get_one_config_group_each(quantized_tiny, export):
    pytest.importorskip("compressed_tensors")
    model, tokenizer = quantized_tiny(
        bits=4,
        group_size=32,
        ignore=["lm_head", r".*layers\.1\.self_attn\.o_proj"],
        overrides={".*down_proj": {"bits": 8, "symmetric": False}},
    )
    out = export("compressed-tensors", model, tokenizer)
    qc = config_of(out)
    assert len(qc["config_groups"]) == 2
    assert sorted(qc["ignore"]) == ["lm_head", "model.layers.1.self_attn.o_proj"]
    eight = [g for g in qc["config_groups"].values() if g["weights"]["num_bits"] == 8][0]
    assert sorted(eight["targets"]) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    weights = _decompress_with_compressed_tensors(out)
    for name, module in quantized_layers(model).items():
        assert torch.equal(weights[name], module.dequantized_weight()), name


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_transformers_loads_and_decompresses_the_checkpoint(quantized_tiny, export):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model, tokenizer = quantized_tiny(bits=4, group_size=32, symmetric=False)
    out = export("compressed-tensors", model, tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    state = loaded.state_dict()
    for name, module in quantized_layers(model).items():
        assert torch.equal(state[f"{name}.weight"], module.dequantized_weight()), name
    ids = torch.tensor([[1, 7, 42, 99, 3, 250]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits, atol=1e-5)


def test_act_order_is_refused(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32)
    name, module = next(iter(quantized_layers(model).items()))
    apply_quantized_weight(model, name, act_order_weight(module.dequantized_weight(), QuantScheme(4, 32, True)))
    with pytest.raises(LmpressInputError, match="act-order"):
        export("compressed-tensors", model, tokenizer)


@pytest.mark.parametrize("bits,group_size,symmetric", [(4, 32, False), (3, 64, True), (8, -1, False)])
def test_lmpress_reads_what_compressed_tensors_compresses(quantized_tiny, export, bits, group_size, symmetric):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import save_file

    from lmpress.export.compressed_tensors import weight_args

    model, tokenizer = quantized_tiny(bits=bits, group_size=group_size, symmetric=symmetric)
    out = export("compressed-tensors", model, tokenizer)
    tensors = load_file(out / "model.safetensors")
    for name, module in quantized_layers(model).items():
        qw = module.unpack()
        scheme = QuantizationScheme(targets=["Linear"], weights=weight_args(qw.scheme))
        offset = 2 ** (bits - 1)
        state = {
            "weight": qw.dequantize(),
            "weight_scale": qw.scales,
            "weight_zero_point": (qw.zeros - offset).to(torch.int8),
        }
        for key in [k for k in tensors if k.startswith(name + ".weight_")]:
            del tensors[key]
        for key, value in PackedQuantizationCompressor.compress(state, scheme).items():
            tensors[f"{name}.{key}"] = value
    save_file(tensors, out / "model.safetensors")
    back = load_quantized_checkpoint(out)
    for name, module in quantized_layers(model).items():
        assert torch.equal(back[name].qweight, module.codes()), name
        assert torch.equal(back[name].zeros, module.zeros.float()), name


def mapped_files_holding(address: int) -> list[str]:
    """The files whose memory mapping in this process holds ``address`` (Linux's /proc/self/maps)."""
    held = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        if start <= address < end and len(fields) > 5:
            held.append(fields[5])
    return held


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_read_back_float_tensors_are_the_files_pages_not_copies(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32, symmetric=True)
    assert model.config.tie_word_embeddings
    out = export("compressed-tensors", model, tokenizer)
    loaded = load_quantized_model(out)
    table = loaded.get_input_embeddings().weight
    # a copy would hold every float tensor twice while the packed codes keep the file mapped
    assert str(out / "model.safetensors") in mapped_files_holding(table.data_ptr())
    assert loaded.get_output_embeddings().weight is table  # the tie survives the parameters' replacement
    ids = torch.tensor([[1, 7, 42, 99, 3, 250]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    table.data.mul_(2)  # the mapping is private: writing the model leaves the export as it was
    assert torch.equal(load_quantized_model(out).get_input_embeddings().weight, model.get_input_embeddings().weight)
    half = load_quantized_model(out, torch.bfloat16)
    assert half.get_input_embeddings().weight.dtype == torch.bfloat16  # the requested dtype, not the stored one
