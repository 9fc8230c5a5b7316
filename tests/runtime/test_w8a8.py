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


IDS = torch.randint(0, 384, (1, 24), generator=torch.Generator().manual_seed(1))


def _logits(model):
    with torch.no_grad():
        return model(IDS, model.new_cache(1, 32))


def _reference(hf):
    with torch.no_grad():
        return hf(IDS).logits


def _without_lmpress_kernels(hf, monkeypatch):
    """The runtime as built where lmpress's C++ kernels do not build."""

    def no_compiler():
        raise RuntimeError("no C++ compiler")

    with monkeypatch.context() as patch:
        patch.setattr(cpu_int, "load_library", no_compiler)
        cpu_int.available.cache_clear()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return Transformer.from_hf(hf, kernels="cpu")
        finally:
            cpu_int.available.cache_clear()


@pytest.mark.skipif(not cpu_int.available(), reason="lmpress's C++ kernels do not build on this host")
def test_runtime_runs_w8a8_on_lmpress_int8_kernel_per_token(smoothquant_tiny, monkeypatch):
    """lmpress's kernel sums in int32 as torch._int_mm does: the runtime's logits are the same bits either way."""
    model = Transformer.from_hf(smoothquant_tiny, kernels="cpu")
    ours = [m for m in model.modules() if isinstance(m, W8A8RowLinear)]
    assert len(ours) >= 6 and all(m.per_token for m in ours)  # fused q/k/v and gate/up, o and down, in 2 layers
    assert not any(isinstance(m, W8A8Linear) for m in model.modules())
    actual = _logits(model)
    assert torch.equal(actual, _logits(_without_lmpress_kernels(smoothquant_tiny, monkeypatch)))
    torch.testing.assert_close(actual, _reference(smoothquant_tiny), atol=1e-4, rtol=1e-4)


def test_without_lmpress_kernels_w8a8_runs_torchs_int8_matmul(smoothquant_tiny, monkeypatch):
    model = _without_lmpress_kernels(smoothquant_tiny, monkeypatch)
    w8a8 = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert len(w8a8) >= 6
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(1) or real(a, b))
    actual = _logits(model)
    assert len(calls) == len(w8a8)
    # per-token int8 quantization of a fused input is the same as of each part's: equal up to float rounding
    torch.testing.assert_close(actual, _reference(smoothquant_tiny), atol=1e-4, rtol=1e-4)
