"""W8A8 (SmoothQuant) as compressed-tensors int-quantized: round trip, the compressed-tensors package, inspect."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmpress.errors import LmpressInputError
from lmpress.export.formats import check_recipe_exports, load_quantized_model, quantized_layers
from lmpress.export.inspect import inspect_artifact
from lmpress.export.inspect_render import render_inspect_text
from lmpress.quantize.smoothquant import SmoothQuantConfig, run_smoothquant
from lmpress.registry import StageContext
from tests.quantize.test_awq import calibration_for


@pytest.fixture
def w8a8_tiny(tiny_llama_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    calibration = calibration_for(tokenizer)
    ctx = StageContext(calibration=lambda: calibration, state_dir=tmp_path / "state", resume=False, fingerprint="x")
    run_smoothquant(model, SmoothQuantConfig(ignore=["lm_head", r".*layers\.1\.mlp\.down_proj"]), ctx)
    return model, tokenizer


def test_round_trip_runs_the_same_int8_model(w8a8_tiny, export):
    model, tokenizer = w8a8_tiny
    out = export("compressed-tensors", model, tokenizer)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "int-quantized"
    (group,) = qc["config_groups"].values()
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"] is True
    assert group["weights"]["strategy"] == "channel" and group["weights"]["num_bits"] == 8
    assert "model.layers.1.mlp.down_proj" in qc["ignore"]
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].shape == (128, 1)
    loaded = load_quantized_model(out)
    layers, back = quantized_layers(model), quantized_layers(loaded)
    assert set(back) == set(layers) and len(layers) == 13
    for name, module in layers.items():
        assert back[name].scheme == module.scheme and back[name].kernel_name() == "w8a8"
        assert torch.equal(back[name].dequantized_weight(), module.dequantized_weight()), name
    ids = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_compressed_tensors_reads_the_w8a8_checkpoint(w8a8_tiny, export):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy

    model, tokenizer = w8a8_tiny
    out = export("compressed-tensors", model, tokenizer)
    raw = json.loads((out / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate({k: v for k, v in raw.items() if k in QuantizationConfig.model_fields})
    (scheme,) = qc.config_groups.values()
    assert scheme.input_activations.strategy == QuantizationStrategy.TOKEN and scheme.input_activations.dynamic
    compressor = BaseCompressor.load_from_registry(qc.format)
    assert type(compressor).__name__ == "IntQuantizationCompressor"
    tensors = load_file(out / "model.safetensors")
    for name, module in quantized_layers(model).items():
        local = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".weight")}
        weight = compressor.decompress(local, scheme)["weight"]
        torch.testing.assert_close(weight.float(), module.dequantized_weight(), rtol=0, atol=0)


def test_inspect_shows_the_activation_scheme(w8a8_tiny, export):
    model, tokenizer = w8a8_tiny
    info = inspect_artifact(export("compressed-tensors", model, tokenizer))
    assert info["ct_format"] == "int-quantized" and info["activations"] == "int8"
    assert info["bits"] == 8 and info["group_size"] == -1 and info["quantized_layers"] == 13
    assert "int8 per-token" in render_inspect_text(info)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "gguf", "onnx"])
def test_formats_without_activation_schemes_refuse_w8a8(fmt):
    with pytest.raises(LmpressInputError, match="activations"):
        check_recipe_exports([SmoothQuantConfig()], [fmt])


def test_writer_refuses_w8a8_layers(w8a8_tiny, export):
    model, tokenizer = w8a8_tiny
    with pytest.raises(LmpressInputError, match="int8 activations"):
        export("gptq", model, tokenizer)
