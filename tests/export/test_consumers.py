"""``lmpress inspect`` says whether vLLM loads an export (lmpress.export.consumers); what vLLM really does with
each is held to these verdicts by tests/evals/test_vllm_consumer.py where vLLM is installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lmpress.evals.agreement_matrix import build_candidate, scheme_named
from lmpress.export.consumers import vllm_cpu_runs_wna16, vllm_refusal
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
        ("W4 g32 sym", "gptq", "loads on this CPU if it has AVX-512"),
        ("W4 g32 sym", "gguf", "refuses: vLLM 0.32 (CPU build) has no GGUF loader"),
        ("W4 g32 sym", "onnx", "refuses: ONNX is not a vLLM format"),
        ("W4 g32 asym", "gptq", "refuses: vLLM 0.32 (CPU build) reads symmetric GPTQ only"),
        ("W4 g32 asym", "compressed-tensors", "loads on this CPU if it has AVX-512"),
        ("W8 g32 sym", "compressed-tensors", "refuses: vLLM 0.32 (CPU build) runs weight-only compressed-tensors"),
        ("W8A8 int8 (SmoothQuant)", "compressed-tensors", "loads"),
    ],
)
def test_inspect_says_whether_vllm_loads_the_export(exports, scheme, fmt, verdict):
    if verdict == "loads on this CPU if it has AVX-512":
        refusal = "refuses: vLLM 0.32 (CPU build) runs 4-bit integer weights (weight-only or W4A8)"
        verdict = "loads" if vllm_cpu_runs_wna16() else refusal
    assert inspect_artifact(exports[(scheme, fmt)])["vllm"].startswith(verdict)


@pytest.mark.parametrize(
    ("scheme", "fmt", "needs_wna16"),
    [
        ("W4 g32 sym", "gptq", True),
        ("W4 g32 asym", "compressed-tensors", True),
        ("W8A8 int8 (SmoothQuant)", "compressed-tensors", False),
    ],
)
def test_4_bit_weight_only_exports_are_refused_where_vllms_cpu_build_lacks_its_wna16_kernel(
    exports, scheme, fmt, needs_wna16
):
    """vLLM 0.32's AVX2 library has no cpu_gemm_wna16: measured, such an export loads and fails at its first
    forward on an AMD EPYC without AVX-512 (tests/evals/test_vllm_consumer.py holds this to vLLM there)."""
    info = inspect_artifact(exports[(scheme, fmt)])
    assert vllm_refusal(info, cpu_wna16=True) is None
    refusal = vllm_refusal(info, cpu_wna16=False)
    if needs_wna16:
        assert refusal is not None and "AVX-512" in refusal and "cpu_gemm_wna16" in refusal
    else:
        assert refusal is None


def test_inspect_reads_a_gguf_file_and_names_its_server(exports):
    gguf = exports[("W4 g32 sym", "gguf")] / "model.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "lmpress.cli", "inspect", str(gguf)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "gguf" in done.stdout and "serve GGUF with llama.cpp" in " ".join(done.stdout.split())


def damaged(export: Path, tmp_path: Path, how: str) -> Path:
    """A copy of ``export`` whose files disagree with its config: bits or group size edited, or a tensor gone."""
    import json

    from safetensors.torch import load_file, save_file

    out = tmp_path / how
    shutil.copytree(export, out)
    config = json.loads((out / "config.json").read_text())
    if how == "bits":
        config["quantization_config"]["bits"] = 8
    elif how == "group-size":
        config["quantization_config"]["group_size"] = 64
    else:
        tensors = load_file(out / "model.safetensors")
        del tensors[next(k for k in sorted(tensors) if k.endswith(".weight_scale"))]
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(("how", "fmt"), [("bits", "gptq"), ("group-size", "gptq"), ("missing", "compressed-tensors")])
@pytest.mark.parametrize("command", ["inspect", "eval"])
def test_an_export_whose_files_disagree_with_its_config_is_refused_before_any_server_sees_it(
    exports, tmp_path, how, fmt, command
):
    """lmpress's inspect and eval refuse it with one line and exit 2 (before a user hands it to vLLM)."""
    scheme = "W4 g32 sym" if fmt == "gptq" else "W4 g32 asym"
    bad = damaged(exports[(scheme, fmt)], tmp_path, how)
    argv = [sys.executable, "-m", "lmpress.cli", command, str(bad)] + (["--quiet"] if command == "eval" else [])
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
