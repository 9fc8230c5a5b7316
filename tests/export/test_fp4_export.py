"""FP4 (NVFP4, MXFP4) exports: compressed-tensors nvfp4/mxfp4-pack-quantized (round trip, compressed-tensors' own
decompressor and config classes, transformers), hf (dequantized), GGUF MXFP4 (gguf-py's dequantizer), refusals
of the formats that cannot hold them, and damaged checkpoints refused with one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lmpress.errors import LmpressInputError
from lmpress.export.formats import check_recipe_exports, load_quantized_checkpoint, load_quantized_model
from lmpress.export.inspect import inspect_artifact
from lmpress.export.inspect_render import render_inspect_text
from lmpress.quantize.rtn import RTNConfig
from lmpress.weights.fp4 import Fp4Linear, Fp4Weight, fp4_layers
from lmpress.weights.qlinear import QuantizedLinear

IDS = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5]])
PRESETS = {("nvfp4", None): "NVFP4A16", ("mxfp4", None): "MXFP4A16", ("mxfp4", "fp4"): "MXFP4"}
CASES = [("nvfp4", None, False), ("mxfp4", None, True), ("mxfp4", "fp4", False)]  # NVFP4 mse: 12 s here


def config_of(out):
    return json.loads((out / "config.json").read_text())["quantization_config"]


def fp4_tiny(quantized_tiny, fmt: str, activations: str | None = None, mse: bool = False, **more):
    settings = {"fp4": fmt, "mse": mse, "activations": activations} | more
    return quantized_tiny(**settings)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("fmt,activations,mse", CASES)
def test_compressed_tensors_round_trip_is_exact(quantized_tiny, export, fmt, activations, mse):
    model, tokenizer = fp4_tiny(quantized_tiny, fmt, activations, mse)
    out = export("compressed-tensors", model, tokenizer)
    qc = config_of(out)
    assert qc["format"] == f"{fmt}-pack-quantized" and qc["ignore"] == ["lm_head"]
    back = load_quantized_checkpoint(out)
    layers = fp4_layers(model)
    assert set(back) == set(layers) and len(layers) == 14
    for name, module in layers.items():
        want = module.unpack()
        assert isinstance(back[name], Fp4Weight) and back[name].scheme == module.scheme
        assert torch.equal(back[name].codes, want.codes), name
        assert torch.equal(back[name].scales, want.scales), name
        if fmt == "nvfp4":
            assert torch.equal(back[name].global_scale, want.global_scale), name
    loaded = load_quantized_model(out)
    assert set(fp4_layers(loaded)) == set(layers)
    assert torch.equal(logits(model), logits(loaded))


@pytest.mark.parametrize("fmt,activations,mse", CASES)
def test_config_group_is_compressed_tensors_preset(quantized_tiny, export, fmt, activations, mse):
    """The config group parses as compressed-tensors' own QuantizationConfig and equals the preset llm-compressor
    applies for this scheme, serialized as its ModelCompressor writes config.json."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    model, tokenizer = fp4_tiny(quantized_tiny, fmt, activations, mse)
    raw = config_of(export("compressed-tensors", model, tokenizer))
    (group,) = raw["config_groups"].values()
    preset = json.loads(json.dumps(preset_name_to_scheme(PRESETS[(fmt, activations)], ["Linear"]).model_dump()))
    assert group["weights"] == preset["weights"]
    assert group["input_activations"] == preset["input_activations"]
    qc = QuantizationConfig.model_validate({k: v for k, v in raw.items() if k in QuantizationConfig.model_fields})
    assert qc.format == f"{fmt}-pack-quantized"


def _decompress(out) -> dict[str, torch.Tensor]:
    """Every FP4 layer's weight as compressed-tensors' registered compressor for the group's format computes it."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from lmpress.export.compressed_tensors import layer_group

    raw = config_of(out)
    tensors = load_file(out / "model.safetensors")
    weights = {}
    for key in [k for k in tensors if k.endswith(".weight_packed")]:
        name = key.removesuffix(".weight_packed")
        group = layer_group(raw, name)
        scheme = QuantizationScheme.model_validate({k: group[k] for k in ("targets", "weights", "input_activations")})
        compressor = BaseCompressor.load_from_registry(group.get("format") or raw["format"])
        local = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")}
        weights[name] = compressor.decompress(local, scheme)["weight"]
    return weights


@pytest.mark.parametrize("fmt,activations,mse", CASES)
def test_compressed_tensors_decompressor_gives_our_weights(quantized_tiny, export, fmt, activations, mse):
    pytest.importorskip("compressed_tensors")
    model, tokenizer = fp4_tiny(quantized_tiny, fmt, activations, mse)
    weights = _decompress(export("compressed-tensors", model, tokenizer))
    layers = fp4_layers(model)
    assert set(weights) == set(layers)
    for name, module in layers.items():
        # compressed-tensors decompresses into bfloat16: our values, rounded there (MXFP4's are exact)
        want = module.dequantized_weight().to(weights[name].dtype)
        torch.testing.assert_close(weights[name], want, atol=0, rtol=0)


def test_mixed_fp4_and_integer_layers_get_a_group_and_format_each(quantized_tiny, export):
    pytest.importorskip("compressed_tensors")
    model, tokenizer = quantized_tiny(
        fp4="nvfp4",
        overrides={".*down_proj": {"fp4": "int", "bits": 4, "group_size": 32}, ".*up_proj": {"fp4": "mxfp4"}},
    )
    out = export("compressed-tensors", model, tokenizer)
    qc = config_of(out)
    assert qc["format"] == "mixed-precision"
    formats = {g["format"]: sorted(g["targets"]) for g in qc["config_groups"].values()}
    assert set(formats) == {"nvfp4-pack-quantized", "mxfp4-pack-quantized", "pack-quantized"}
    assert formats["pack-quantized"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert formats["mxfp4-pack-quantized"] == ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]
    loaded = load_quantized_model(out)
    assert isinstance(loaded.model.layers[0].mlp.down_proj, QuantizedLinear)
    assert loaded.model.layers[1].mlp.up_proj.fmt == "mxfp4" and loaded.model.layers[1].mlp.gate_proj.fmt == "nvfp4"
    assert torch.equal(logits(model), logits(loaded))
    weights = _decompress(out)
    for name, module in fp4_layers(model).items():
        torch.testing.assert_close(weights[name], module.dequantized_weight().to(weights[name].dtype), atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_transformers_loads_and_decompresses_the_checkpoint(quantized_tiny, export, fmt):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model, tokenizer = fp4_tiny(quantized_tiny, fmt)
    out = export("compressed-tensors", model, tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    state = loaded.state_dict()
    for name, module in fp4_layers(model).items():
        got = state[f"{name}.weight"]  # decompressed in bfloat16 (exact for MXFP4), held as the model's float32
        torch.testing.assert_close(got, module.dequantized_weight().to(torch.bfloat16).to(got.dtype), atol=0, rtol=0)
    # NVFP4 weights pass through bfloat16 there; the logits agree to that rounding
    torch.testing.assert_close(logits(loaded).float(), logits(model), atol=2e-2 if fmt == "nvfp4" else 1e-5, rtol=0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_lmpress_reads_what_compressed_tensors_compresses(quantized_tiny, export, fmt):
    """The other direction: compressed-tensors' compressor writes each layer from our values and scales; lmpress
    reads back our codes and scales."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    model, tokenizer = fp4_tiny(quantized_tiny, fmt)
    out = export("compressed-tensors", model, tokenizer)
    tensors = load_file(out / "model.safetensors")
    compressor = BaseCompressor.load_from_registry(f"{fmt}-pack-quantized")
    preset = preset_name_to_scheme(PRESETS[(fmt, None)], ["Linear"])
    for name, module in fp4_layers(model).items():
        q = module.unpack()
        state = {"weight": q.dequantize(), "weight_scale": q.scales}
        if fmt == "nvfp4":
            state["weight_global_scale"] = q.global_scale
        for key in [k for k in tensors if k.startswith(name + ".weight_")]:
            del tensors[key]
        tensors |= {f"{name}.{k}": v for k, v in compressor.compress(state, preset).items()}
    save_file(tensors, out / "model.safetensors")
    back = load_quantized_checkpoint(out)
    for name, module in fp4_layers(model).items():
        assert torch.equal(back[name].codes, module.unpack().codes) and torch.equal(
            back[name].scales, module.unpack().scales
        )


def _damage(out, key: str, edit) -> None:
    tensors = load_file(out / "model.safetensors")
    tensors[key] = edit(tensors[key].clone())
    save_file(tensors, out / "model.safetensors")


def _set_first(value: float):
    def edit(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[0] = value
        return t

    return edit


@pytest.mark.parametrize(
    "fmt,key,edit,message",
    [
        ("mxfp4", "weight_scale", lambda t: _set_first(255)(t), r"weight_scale\[0, 0\] is E8M0 byte 255"),
        ("nvfp4", "weight_scale", lambda t: _set_first(float("nan"))(t.float()).to(t.dtype), r"E4M3 block scales"),
        ("nvfp4", "weight_scale", lambda t: _set_first(-2.0)(t.float()).to(t.dtype), r"non-negative"),
        ("nvfp4", "weight_global_scale", lambda t: _set_first(float("inf"))(t), r"finite positive"),
        ("nvfp4", "weight_global_scale", lambda t: _set_first(0.0)(t), r"finite positive"),
        ("nvfp4", "weight_scale", lambda t: t.float(), r"is torch.float32, expected torch.float8_e4m3fn"),
        ("mxfp4", "weight_scale", lambda t: t[:, :-1].contiguous(), r"has shape \(\d+, 3\), expected \(\d+, 4\)"),
        ("mxfp4", "weight_packed", lambda t: t[:, :-8].contiguous(), r"not whole MXFP4 blocks of 32"),
    ],
)
def test_damaged_fp4_tensors_are_refused_naming_the_tensor(quantized_tiny, export, fmt, key, edit, message):
    model, tokenizer = fp4_tiny(quantized_tiny, fmt, mse=False, ignore=[])
    out = export("compressed-tensors", model, tokenizer)
    _damage(out, f"lm_head.{key}", edit)
    with pytest.raises(LmpressInputError, match=message) as info:
        load_quantized_checkpoint(out)
    assert "\n" not in str(info.value) and "lm_head" in str(info.value)


def test_hf_export_holds_the_dequantized_weights(quantized_tiny, export):
    from transformers import AutoModelForCausalLM

    model, tokenizer = fp4_tiny(quantized_tiny, "nvfp4", ignore=[])
    out = export("hf", model, tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert not loaded.config.tie_word_embeddings  # the FP4 head no longer equals the embedding
    state = loaded.state_dict()
    for name, module in fp4_layers(model).items():
        assert torch.equal(state[f"{name}.weight"], module.dequantized_weight()), name
    assert torch.equal(logits(model), logits(loaded))


def test_gguf_writes_mxfp4_blocks_gguf_py_dequantizes_to_our_weights(quantized_tiny, export):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    from lmpress.export.gguf import gguf_tensor_name, read_gguf, rope_row_order

    model, tokenizer = fp4_tiny(quantized_tiny, "mxfp4")
    out = export("gguf", model, tokenizer)
    reader = gguf.GGUFReader(str(out / "model.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    config = model.config
    for name, module in fp4_layers(model).items():
        t = tensors[gguf_tensor_name(name) + ".weight"]
        assert t.tensor_type.name == "MXFP4"
        values = dequantize(np.asarray(t.data), t.tensor_type).reshape(module.out_features, module.in_features)
        want = module.dequantized_weight()
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(name.split(".")[-1])
        if heads:
            want = want[rope_row_order(want.shape[0], heads)]
        assert np.array_equal(values, want.numpy()), name
    back = read_gguf(out)
    for name, module in fp4_layers(model).items():
        got = back.get_submodule(name)
        assert isinstance(got, Fp4Linear) and torch.equal(got.weight_packed, module.weight_packed), name
        assert torch.equal(got.weight_scale, module.weight_scale), name
    assert torch.equal(logits(model), logits(back))
    info = inspect_artifact(out)
    assert info["tensor_types"]["MXFP4"] == 14 and (info["fp4"], info["scale_encoding"]) == ("mxfp4", "E8M0")
    assert "llama.cpp" in info["vllm"]


def test_mxfp4_blocks_at_the_e8m0_extremes_match_gguf_py():
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from lmpress.export.ggml_blocks import pack_mxfp4, unpack_mxfp4

    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4, 64), dtype=torch.uint8, generator=generator)
    codes[codes == 8] = 0
    exponents = torch.tensor([[0, 1], [126, 127], [128, 200], [251, 252]], dtype=torch.uint8)  # 253+: 6x overflows
    weight = Fp4Weight(codes, torch.exp2(exponents.double() - 127).float(), RTNConfig(fp4="mxfp4").scheme_for("x"))
    blocks = pack_mxfp4(codes, exponents)
    assert blocks.shape == (4, 2 * 17)
    values = dequantize(blocks, GGMLQuantizationType.MXFP4).reshape(4, 64)
    assert np.array_equal(values, weight.dequantize().numpy())
    back_codes, back_exponents = unpack_mxfp4(blocks, 64)
    assert torch.equal(back_codes, codes) and torch.equal(back_exponents, exponents)


@pytest.mark.parametrize(
    "fmt,activations,export_format,message",
    [
        ("nvfp4", None, "gptq", "NVFP4 weights .*which gptq cannot hold.*export compressed-tensors"),
        ("mxfp4", None, "awq", "MXFP4 weights .*which awq cannot hold.*or gguf for MXFP4"),
        ("mxfp4", None, "onnx", "which onnx cannot hold"),
        ("nvfp4", None, "gguf", "no per-tensor global scale.*use fp4: mxfp4 for GGUF"),
        ("mxfp4", "fp4", "gguf", r"fp4 activations \(W4A4\), which gguf cannot describe"),
        ("mxfp4", "fp4", "hf", r"fp4 activations \(W4A4\), which hf cannot describe"),
    ],
)
def test_formats_that_cannot_hold_fp4_refuse_from_the_recipe(fmt, activations, export_format, message):
    stage = RTNConfig(fp4=fmt, activations=activations)
    with pytest.raises(LmpressInputError, match=message) as info:
        check_recipe_exports([stage], [export_format])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fmt,export_format", [("nvfp4", "compressed-tensors"), ("nvfp4", "hf"), ("mxfp4", "gguf")])
def test_formats_that_hold_fp4_accept_it(fmt, export_format):
    check_recipe_exports([RTNConfig(fp4=fmt)], [export_format])


@pytest.mark.parametrize("export_format", ["gptq", "awq", "onnx", "bitsandbytes"])
def test_writers_refuse_fp4_layers_even_outside_a_run(quantized_tiny, export, export_format):
    model, tokenizer = fp4_tiny(quantized_tiny, "mxfp4", mse=False)
    with pytest.raises(LmpressInputError, match="MXFP4 weights"):
        export(export_format, model, tokenizer)


def test_inspect_shows_fp4_layers_and_their_consumers(quantized_tiny, export):
    model, tokenizer = fp4_tiny(quantized_tiny, "nvfp4", overrides={".*down_proj": {"fp4": "mxfp4"}})
    info = inspect_artifact(export("compressed-tensors", model, tokenizer))
    assert info["ct_format"] == "mixed-precision" and info["quantized_layers"] == 14
    assert info["fp4"] == ["mxfp4", "nvfp4"] and info["bits"] == 4
    row = next(r for r in info["layers"] if r["name"] == "model.layers.0.self_attn.q_proj")
    assert (row["fp4"], row["group_size"], row["scale_encoding"]) == ("nvfp4", 16, "E4M3 / global float32")
    down = next(r for r in info["layers"] if r["name"] == "model.layers.0.mlp.down_proj")
    assert (down["fp4"], down["group_size"], down["scale_encoding"]) == ("mxfp4", 32, "E8M0")
    # 4 bits + an 8-bit scale per 16 (NVFP4) or 32 (MXFP4) weights; plus the global scale
    assert 4.5 <= row["bits_per_weight"] < 4.6 and 4.25 <= down["bits_per_weight"] < 4.26
    assert "vLLM" in info["vllm"] and "NVFP4" in info["vllm"]
    text = render_inspect_text(info, width=200)
    assert "E4M3 / global float32" in text and "E8M0" in text


def test_nvfp4_w4a4_layers_keep_their_input_global_scale(quantized_tiny, export):
    """NVFP4 W4A4 (what a calibrating stage makes: rtn refuses to guess the activation range): the static
    ``input_global_scale`` is written as the NVFP4 preset's tensor and read back, and the activations run as
    compressed-tensors' NVFP4 preset defines them."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import preset_name_to_scheme

    from lmpress.weights.apply import apply_quantized_weight
    from lmpress.weights.scheme import QuantScheme

    model, tokenizer = fp4_tiny(quantized_tiny, "nvfp4")
    w4a4 = QuantScheme(4, 16, True, "fp4", fp4="nvfp4")
    for i, (name, module) in enumerate(fp4_layers(model).items()):
        q = module.unpack()
        q.scheme, q.input_global_scale = w4a4, torch.tensor([448.0 * 6 / (2.0 + i)])
        apply_quantized_weight(model, name, q)
    out = export("compressed-tensors", model, tokenizer)
    (group,) = config_of(out)["config_groups"].values()
    preset = json.loads(json.dumps(preset_name_to_scheme("NVFP4", ["Linear"]).model_dump()))
    assert group["input_activations"] == preset["input_activations"]
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.1.mlp.down_proj.input_global_scale"].dtype == torch.float32
    back = load_quantized_checkpoint(out)
    for name, module in fp4_layers(model).items():
        assert back[name].scheme == w4a4 and torch.equal(back[name].input_global_scale, module.input_global_scale)
    assert torch.equal(logits(model), logits(load_quantized_model(out)))
    _damage(out, "model.layers.0.self_attn.q_proj.input_global_scale", _set_first(float("nan")))
    with pytest.raises(LmpressInputError, match="q_proj.input_global_scale is nan"):
        load_quantized_checkpoint(out)
