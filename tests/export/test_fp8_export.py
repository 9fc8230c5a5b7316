"""FP8 as compressed-tensors float-quantized: round trip, the compressed-tensors package, inspect."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmpress.export.formats import load_quantized_model
from lmpress.export.inspect import inspect_artifact
from lmpress.quantize.fp8 import FP8Config, run_fp8
from lmpress.registry import StageContext
from lmpress.weights.float8 import fp8_layers


def fp8_tiny(tiny_llama_dir, tmp_path, weights: str):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ctx = StageContext(calibration=lambda: None, state_dir=tmp_path, resume=False, fingerprint="x")
    run_fp8(model, FP8Config(weights=weights, ignore=["lm_head", r".*layers\.0\.mlp\.up_proj"]), ctx)
    return model, tokenizer


@pytest.mark.parametrize("weights", ["channel", "tensor"])
def test_round_trip_and_compressed_tensors(tiny_llama_dir, tmp_path, export, weights):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    model, tokenizer = fp8_tiny(tiny_llama_dir, tmp_path, weights)
    out = export("compressed-tensors", model, tokenizer)
    raw = json.loads((out / "config.json").read_text())["quantization_config"]
    assert raw["format"] == "float-quantized" and "model.layers.0.mlp.up_proj" in raw["ignore"]
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    loaded = load_quantized_model(out)
    assert set(fp8_layers(loaded)) == set(fp8_layers(model))
    ids = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)

    qc = QuantizationConfig.model_validate({k: v for k, v in raw.items() if k in QuantizationConfig.model_fields})
    (scheme,) = qc.config_groups.values()
    assert scheme.weights.type == "float" and scheme.weights.strategy == weights
    assert scheme.input_activations.type == "float" and scheme.input_activations.dynamic
    compressor = BaseCompressor.load_from_registry(qc.format)
    assert type(compressor).__name__ == "FloatQuantizationCompressor"
    for name, module in fp8_layers(model).items():
        local = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".weight")}
        weight = compressor.decompress(local, scheme)["weight"]
        torch.testing.assert_close(weight.float(), module.dequantized_weight(), rtol=0, atol=0)

    info = inspect_artifact(out)
    assert info["ct_format"] == "float-quantized" and info["activations"] == "fp8"
    assert info["quantized_layers"] == 13


def test_smoothquant_fp8_exports_as_float_quantized(tiny_llama_dir, tmp_path, export):
    """The smoothquant stage with activations: fp8 (GPTQ onto E4M3) ships like the fp8 stage: read back identical."""
    from lmpress.quantize.smoothquant import SmoothQuantConfig, run_smoothquant
    from tests.quantize.test_awq import calibration_for, context

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    config = SmoothQuantConfig(activations="fp8", alpha=0.5, rounding="gptq")
    run_smoothquant(model, config, context(tmp_path / "state", calibration_for(tokenizer)))
    out = export("compressed-tensors", model, tokenizer)
    raw = json.loads((out / "config.json").read_text())["quantization_config"]
    assert raw["format"] == "float-quantized"
    loaded = load_quantized_model(out)
    assert len(fp8_layers(loaded)) == 14
    ids = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_runtime_reads_an_fp8_artifact_and_names_its_kernel(tiny_llama_dir, tmp_path, export):
    """An FP8 export runs on lmpress's runtime (it used to refuse: "cannot run ... Fp8Weight layer"): on the CPU the
    E4M3 product simulated in float, the transformers-side model's own numerics; the same layers built for
    ``_scaled_mm`` (what a GPU with FP8 tensor cores runs, torch's CPU op here) agree within bf16 output rounding."""
    pytest.importorskip("compressed_tensors")
    from lmpress.runtime.checkpoint import load_checkpoint
    from lmpress.runtime.kernels import build_kernel
    from lmpress.runtime.throughput import layer_kernels

    model, tokenizer = fp8_tiny(tiny_llama_dir, tmp_path, "channel")
    out = export("compressed-tensors", model, tokenizer)
    runtime = load_checkpoint(out)
    kernels = layer_kernels(runtime)
    assert kernels["layers.1.attention.wqkv.0"] == "fp8-simulated" and kernels["layers.0.feed_forward.w13.0"] == (
        "fp8-simulated"
    )
    assert kernels["layers.0.feed_forward.w13.1"] == "dense" and kernels["output"] == "dense"  # ignored: float
    ids = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5]])
    cache = runtime.new_cache(1, 16)
    with torch.no_grad():
        logits = runtime(ids, cache)
        expected = model(ids).logits
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)

    layer = runtime.layers[1].attention.wqkv.parts[0]
    scaled = build_kernel("fp8-scaled-mm", layer, torch.bfloat16)
    x = torch.randn(4, layer.in_features)
    noise = (scaled(x) - layer(x)).pow(2).sum() / layer(x).pow(2).sum()
    assert float(10 * torch.log10(1 / noise)) >= 45
