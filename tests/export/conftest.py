"""Fixtures for the export tests: the tiny Llamas quantized in place by RTN, and a writer runner."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmpress.quantize.rtn import RTNConfig, run_rtn
from lmpress.registry import StageContext, exporter


def rtn_quantizer(model_dir: Path, tmp_path: Path):
    def quantize(**rtn_config):
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        ctx = StageContext(calibration=lambda: None, state_dir=tmp_path / "state", resume=False, fingerprint="x")
        run_rtn(model, RTNConfig(**rtn_config), ctx)
        return model, tokenizer

    return quantize


@pytest.fixture
def quantized_tiny(tiny_llama_dir, tmp_path):
    """``quantize(**rtn_config) -> (model, tokenizer)``: a fresh tiny Llama with RTN applied."""
    return rtn_quantizer(tiny_llama_dir, tmp_path)


@pytest.fixture
def quantized_wide(tiny_llama_wide_dir, tmp_path):
    """``quantize(**rtn_config) -> (model, tokenizer)``: a fresh wide tiny Llama with RTN applied."""
    return rtn_quantizer(tiny_llama_wide_dir, tmp_path)


@pytest.fixture
def export(tmp_path):
    """``export(fmt, model, tokenizer) -> Path``: run the registered writer into a fresh directory."""

    def run(fmt: str, model, tokenizer) -> Path:
        out = tmp_path / f"out-{fmt}-{len(list(tmp_path.glob('out-*')))}"
        out.mkdir()
        exporter(fmt)(model, tokenizer, out)
        return out

    return run
