"""The CUDA kernels select.py picks, on a real GPU (skipped without one): tinygemm's packing and its
scale-and-zero, the runtime built with ``kernels="cuda"``, FP8 ``_scaled_mm``, W8A8 ``_int_mm``, and the
tuned Triton configurations reaching the on-disk cache. Bounds as in test_kernel_select.py (42 dB for
bf16 kernels; the CPU twins of these checks run there)."""

from __future__ import annotations

import json

import pytest
import torch

from lmpress.runtime.kernels import build_kernel, kernel_of
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn
from tests.runtime.test_kernel_select import TINYGEMM_MIN_DB, sqnr_db, w4_layer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 300])
def test_tinygemm_on_the_gpu_matches_the_dequantized_weight(group, symmetric, act_order, rows):
    layer = w4_layer(256, 1024, group, symmetric, act_order, bias=True)
    module = build_kernel("tinygemm", layer, torch.bfloat16).to("cuda")
    assert module.packed_for_gpu and module.weight.dim() == 4
    x = torch.randn(rows, 1024, device="cuda")
    reference = x.double().cpu() @ layer.dequantized_weight(torch.float64).T + layer.bias.double()
    assert sqnr_db(reference, module(x).cpu()) >= TINYGEMM_MIN_DB


def test_runtime_on_cuda_kernels_matches_the_cpu_runtime():
    """A W4 g32 tiny model built for CUDA (tinygemm on sm80+, fused RMSNorm) against the CPU runtime."""
    from lmpress.runtime.model import Transformer
    from lmpress.runtime.throughput import layer_kernels
    from tests.runtime.conftest import tiny_hf_model

    hf = tiny_hf_model("llama", seed=4)
    for block in hf.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    qw = quantize_weight_rtn(child.weight.detach(), QuantScheme(4, 32, False))
                    setattr(parent, name, QuantizedLinear.from_quantized_weight(qw))
    gpu = Transformer.from_hf(hf, dtype=torch.bfloat16, device="cuda")
    cpu = Transformer.from_hf(hf, dtype=torch.float32)
    kernels = set(layer_kernels(gpu).values())
    expected = "tinygemm" if torch.cuda.get_device_capability() >= (8, 0) else "triton"
    assert kernels == {expected, "dense"}, kernels
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        a = gpu(ids, gpu.new_cache(1, 16)).float().cpu()
        b = cpu(ids, cpu.new_cache(1, 16))
    assert sqnr_db(b, a) >= 25  # a whole bf16 model against float32: rounding compounds over layers


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="FP8 needs sm89+"
)
def test_fp8_scaled_mm_on_the_gpu():
    from lmpress.weights.float8 import Fp8Linear, quantize_fp8_per_token

    linear = torch.nn.Linear(512, 256, bias=True).requires_grad_(False)
    fp8 = Fp8Linear.from_linear(linear, "channel")
    module = build_kernel("fp8-scaled-mm", fp8, torch.bfloat16).to("cuda")
    x = torch.randn(37, 512)
    codes, scale = quantize_fp8_per_token(x)
    reference = (codes.double() * scale.double()) @ fp8.dequantized_weight(torch.float64).T + linear.bias.double()
    assert sqnr_db(reference, module(x.cuda()).cpu()) >= 45


def test_w8a8_int_mm_on_the_gpu():
    from lmpress.weights.int8_linear import w8a8_reference

    qw = quantize_weight_rtn(torch.randn(256, 512) * 0.02, QuantScheme(8, -1, True, activations="int8"))
    layer = QuantizedLinear.from_quantized_weight(qw)
    module = build_kernel("int8-mm", layer, torch.bfloat16).to("cuda")
    assert kernel_of(module) == "int8-mm"
    for rows in (1, 40):
        x = torch.randn(rows, 512)
        codes = (layer.codes().to(torch.int16) - 128).float()
        expected = w8a8_reference(x, codes, layer.scales[:, 0].float())
        assert sqnr_db(expected, module(x.cuda()).cpu()) >= 45


def test_tuned_triton_configs_reach_the_disk_cache(tmp_path, monkeypatch):
    from lmpress.runtime.kernels import triton as tk
    from lmpress.runtime.kernels import tuning

    monkeypatch.setenv("LMPRESS_TUNE_CACHE", str(tmp_path / "tune.json"))
    monkeypatch.setattr(tuning, "_space", "small")
    monkeypatch.setattr(tk, "AUTOTUNE", True)
    tuning.forget_in_memory()
    layer = w4_layer(512, 1024, 128, True)
    packed = tk.prepare_w4a16(layer)
    packed = tk.PackedWeight(**{k: v.cuda() if torch.is_tensor(v) else v for k, v in vars(packed).items()})
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    first = tk.w4a16_matmul(x, packed)
    choices = json.loads((tmp_path / "tune.json").read_text())["choices"]
    assert len(choices) == 1 and next(iter(choices.values())) in tk.SMALL_CONFIGS["gemv_row"]
    tuning.forget_in_memory()
    assert torch.equal(tk.w4a16_matmul(x, packed), first)  # the stored config, read back
    tuning.forget_in_memory()
