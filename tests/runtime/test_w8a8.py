"""The runtime runs W8A8 layers with the int8 execution QuantizedLinear scores them with: per-token int8 activations
times int8 weights, on lmpress's CPU kernel where it builds, else torch._int_mm."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmpress.quantize.smoothquant import SmoothQuantConfig, run_smoothquant
from lmpress.registry import StageContext
from lmpress.runtime.kernels import cpu_int
from lmpress.runtime.kernels.cpu_int import W8A8RowLinear
from lmpress.runtime.kernels.int8 import W8A8Linear
from lmpress.runtime.model import Transformer
from tests.quantize.test_awq import calibration_for


@pytest.fixture(scope="module")
def smoothquant_tiny(tiny_llama_dir, tmp_path_factory):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    calibration = calibration_for(AutoTokenizer.from_pretrained(tiny_llama_dir))
    state = tmp_path_factory.mktemp("state")
    ctx = StageContext(calibration=lambda: calibration, state_dir=state, resume=False, fingerprint="x")
    run_smoothquant(hf, SmoothQuantConfig(), ctx)
    return hf


def _logits(model, hf):
    ids = torch.randint(0, hf.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids, model.new_cache(1, 32)), hf(ids).logits


@pytest.mark.skipif(not cpu_int.available(), reason="lmpress's C++ kernels do not build on this host")
def test_runtime_runs_w8a8_on_lmpress_int8_kernel_per_token(smoothquant_tiny, monkeypatch):
    model = Transformer.from_hf(smoothquant_tiny, kernels="cpu")
    ours = [m for m in model.modules() if isinstance(m, W8A8RowLinear)]
    assert len(ours) >= 6 and all(m.per_token for m in ours)  # fused q/k/v and gate/up, o and down, in 2 layers
    assert not any(isinstance(m, W8A8Linear) for m in model.modules())
    actual, expected = _logits(model, smoothquant_tiny)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_without_lmpress_kernels_w8a8_runs_torchs_int8_matmul(smoothquant_tiny, monkeypatch):
    def no_compiler():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_int, "load_library", no_compiler)
    cpu_int.available.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = Transformer.from_hf(smoothquant_tiny, kernels="cpu")
    finally:
        cpu_int.available.cache_clear()
    w8a8 = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert len(w8a8) >= 6
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(1) or real(a, b))
    actual, expected = _logits(model, smoothquant_tiny)
    assert len(calls) == len(w8a8)
    # per-token int8 quantization of a fused input is the same as of each part's: equal up to float rounding
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
