"""The runtime runs W8A8 layers with the same int8 execution (torch._int_mm) as QuantizedLinear."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmpress.quantize.smoothquant import SmoothQuantConfig, run_smoothquant
from lmpress.registry import StageContext
from lmpress.runtime.kernels.int8 import W8A8Linear
from lmpress.runtime.model import Transformer
from tests.quantize.test_awq import calibration_for


def test_runtime_runs_w8a8_with_int8_matmul(tiny_llama_dir, tmp_path, monkeypatch):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    calibration = calibration_for(AutoTokenizer.from_pretrained(tiny_llama_dir))
    ctx = StageContext(calibration=lambda: calibration, state_dir=tmp_path, resume=False, fingerprint="x")
    run_smoothquant(hf, SmoothQuantConfig(), ctx)
    model = Transformer.from_hf(hf, kernels="cpu")
    w8a8 = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert len(w8a8) >= 6  # fused q/k/v and gate/up, o and down, in each of the 2 layers
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(1) or real(a, b))
    ids = torch.randint(0, hf.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        actual = model(ids, model.new_cache(1, 32))
        n_runtime = len(calls)
        expected = hf(ids).logits
    assert n_runtime == len(w8a8)
    # per-token int8 quantization of a fused input is the same as of each part's: equal up to float rounding
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
