"""``lmpress inspect`` says whether vLLM loads an export (lmpress.export.consumers); what vLLM really does with
each is held to these verdicts by tests/evals/test_vllm_consumer.py where vLLM is installed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from lmpress.evals.agreement_matrix import build_candidate, scheme_named
from lmpress.export.inspect import inspect_artifact
from lmpress.registry import exporter
from tests.quantize.test_awq import calibration_for


@pytest.fixture(scope="module")
def exports(tiny_llama_wide_dir, tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_wide_dir)
    calibration = calibration_for(tokenizer)
    root = tmp_path_factory.mktemp("consumers")
    written = {}
    for scheme, formats in {
        "W4 g32 sym": ("gptq", "gguf", "onnx"),
        "W4 g32 asym": ("gptq", "compressed-tensors"),
        "W8 g32 sym": ("compressed-tensors",),
        "W8A8 int8 (SmoothQuant)": ("compressed-tensors",),
    }.items():
        candidate = build_candidate(tiny_llama_wide_dir, scheme_named(scheme), calibration, root / "state" / scheme)
        for fmt in formats:
            out = root / f"{len(written)}"
            out.mkdir()
            exporter(fmt)(candidate, tokenizer, out)
            written[(scheme, fmt)] = out
    return written


@pytest.mark.parametrize(
    ("scheme", "fmt", "verdict"),
    [
        ("W4 g32 sym", "gptq", "loads"),
        ("W4 g32 sym", "gguf", "refuses: vLLM 0.32 (CPU build) has no GGUF loader"),
        ("W4 g32 sym", "onnx", "refuses: ONNX is not a vLLM format"),
        ("W4 g32 asym", "gptq", "refuses: vLLM 0.32 (CPU build) reads symmetric GPTQ only"),
        ("W4 g32 asym", "compressed-tensors", "loads"),
        ("W8 g32 sym", "compressed-tensors", "refuses: vLLM 0.32 (CPU build) runs weight-only compressed-tensors"),
        ("W8A8 int8 (SmoothQuant)", "compressed-tensors", "loads"),
    ],
)
def test_inspect_says_whether_vllm_loads_the_export(exports, scheme, fmt, verdict):
    assert inspect_artifact(exports[(scheme, fmt)])["vllm"].startswith(verdict)


def test_inspect_reads_a_gguf_file_and_names_its_server(exports):
    gguf = exports[("W4 g32 sym", "gguf")] / "model.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "lmpress.cli", "inspect", str(gguf)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "gguf" in done.stdout and "serve GGUF with llama.cpp" in " ".join(done.stdout.split())
