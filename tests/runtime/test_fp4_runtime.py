"""FP4 exports in lmpress's runtime: a compressed-tensors NVFP4/MXFP4 checkpoint read straight into the runtime,
a GGUF MXFP4 file through the loader, the kernel each FP4 layer runs (named per layer, as ``lmpress bench``
prints it), and the evaluator's loader."""

from __future__ import annotations

import pytest
import torch

from lmpress.registry import exporter
from lmpress.runtime.kernels import kernel_of
from lmpress.runtime.kernels.select import DeviceCase, LayerCase, kernel_candidates
from lmpress.weights.fp4 import Fp4Linear, fp4_layers
from lmpress.weights.scheme import QuantScheme
from tests.export.conftest import rtn_quantizer

IDS = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5]])


def export_fp4(tiny_llama_dir, tmp_path, fmt: str, **rtn):
    model, tokenizer = rtn_quantizer(tiny_llama_dir, tmp_path)(**({"fp4": "nvfp4"} | rtn))
    out = tmp_path / fmt
    out.mkdir()
    exporter(fmt)(model, tokenizer, out)
    return model, out


def runtime_logits(runtime) -> torch.Tensor:
    with torch.no_grad():
        return runtime(IDS, runtime.new_cache(1, IDS.shape[1]))


def reference_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def assert_close_to_int8_activations(runtime: torch.Tensor, reference: torch.Tensor) -> None:
    """The CPU build's FP4 A16 layers take int8 activations per 4 (cpu_fp4.cpp): logits within that rounding
    (SQNR over 30 dB against the float execution), and the same greedy tokens."""
    noise = (runtime - reference).pow(2).sum() / reference.pow(2).sum()
    assert float(10 * torch.log10(1 / noise)) > 30
    assert torch.equal(runtime.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("rtn", [{"fp4": "nvfp4"}, {"fp4": "mxfp4"}, {"fp4": "mxfp4", "activations": "fp4"}])
def test_runtime_reads_a_compressed_tensors_fp4_checkpoint(tiny_llama_dir, tmp_path, rtn, monkeypatch):
    from lmpress.runtime.checkpoint import load_checkpoint
    from lmpress.runtime.throughput import layer_kernels

    model, out = export_fp4(tiny_llama_dir, tmp_path, "compressed-tensors", **rtn)
    runtime = load_checkpoint(out)
    kernels = layer_kernels(runtime)
    if rtn.get("activations"):  # W4A4: each layer runs itself, activations quantized per block
        assert kernels["layers.0.attention.wqkv.0"] == "fp4-simulated" == kernels["layers.1.feed_forward.w2"]
        reference = reference_logits(model)

        def dequantize_again(*_):  # noqa: ANN202 - Fp4Linear.dequantized_weight's
            raise AssertionError("the runtime dequantizes an FP4 weight at each call")

        monkeypatch.setattr(Fp4Linear, "dequantized_weight", dequantize_again)  # built once, when loaded
        torch.testing.assert_close(runtime_logits(runtime), reference, atol=1e-4, rtol=1e-4)
    else:  # A16: lmpress's FP4 x int8 CPU kernel, q/k/v (and gate/up) fused into one
        assert kernels["layers.0.attention.wqkv"] == "cpu-fp4a8" == kernels["layers.1.feed_forward.w13"]
        assert_close_to_int8_activations(runtime_logits(runtime), reference_logits(model))
        dense = load_checkpoint(out, cpu_activations="bf16")  # where the int8 kernels are not asked for: dense
        assert layer_kernels(dense)["layers.0.attention.wqkv"] == "dense"
        torch.testing.assert_close(runtime_logits(dense), reference_logits(model), atol=1e-4, rtol=1e-4)
    assert kernels["output"] == "dense"  # lm_head: ignored, float


def test_runtime_and_evaluator_read_a_gguf_mxfp4_export(tiny_llama_dir, tmp_path):
    from lmpress.loader import load_model
    from lmpress.runtime.text import load_runtime

    model, out = export_fp4(tiny_llama_dir, tmp_path, "gguf", fp4="mxfp4")
    evaluator = load_model(str(out), "float32", fingerprint=False).model
    assert len(fp4_layers(evaluator)) == 14
    torch.testing.assert_close(reference_logits(evaluator), reference_logits(model), atol=1e-5, rtol=0)
    runtime, _ = load_runtime(str(out))
    assert_close_to_int8_activations(runtime_logits(runtime), reference_logits(model))


def test_runtime_built_from_a_transformers_model_with_fp4_layers(tiny_llama_dir, tmp_path):
    """``Transformer.from_hf`` (what the evaluator's model becomes in the runtime): FP4 layers accepted like FP8."""
    from lmpress.runtime.model import Transformer

    model, _ = rtn_quantizer(tiny_llama_dir, tmp_path)(fp4="mxfp4", overrides={".*o_proj": {"activations": "fp4"}})
    runtime = Transformer.from_hf(model)
    # W4A4: its weight dequantized once, its activations quantized per block at each call
    assert kernel_of(runtime.layers[0].attention.wo.parts[0]) == "fp4-simulated"
    assert_close_to_int8_activations(runtime_logits(runtime), reference_logits(model))


@pytest.mark.parametrize("device", [DeviceCase("cpu", torch.float32), DeviceCase("cuda", torch.bfloat16, (9, 0))])
def test_fp4_layers_never_take_an_integer_kernel(device):
    layer = Fp4Linear(64, 32, QuantScheme(4, 16, True, fp4="nvfp4"))
    case = LayerCase.of(layer)
    assert (case.fp4, case.group_width, case.activations) == ("nvfp4", 16, None)
    # the CPU: lmpress's FP4 x int8 kernel first (widths of 64k); a GPU: dequantized once
    assert kernel_candidates(case, device) == (("cpu-fp4a8", "dense") if device.type == "cpu" else ("dense",))
    narrow = LayerCase(4, 16, 48, 32, fp4="nvfp4")
    assert kernel_candidates(narrow, device) == ("dense",)
    w4a4 = LayerCase(4, 32, 64, 32, activations="fp4", fp4="mxfp4")
    assert kernel_candidates(w4a4, device) == ("fp4-simulated",)
