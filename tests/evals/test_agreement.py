"""One truth per artifact: runtime, evaluator, float reference and installed consumers agree on every export.

The matrix test runs every (scheme, format) pair on a tiny random Llama (hidden 256: whole k-quant
super-blocks) and writes what ran into docs/agreement.md. A pair is either refused before any work or
agrees; a disagreement or a writer refusing only after quantizing fails it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmpress.evals.agreement_matrix import (
    FORMATS,
    SCHEMES,
    build_candidate,
    check_pair,
    render_matrix,
    scheme_named,
    write_section,
)
from tests.quantize.test_awq import calibration_for

DOC = Path(__file__).resolve().parents[2] / "docs" / "agreement.md"
RAN: list = []


@pytest.fixture(scope="module")
def agreement_doc():
    yield RAN
    if RAN:
        command = "python -m pytest tests/evals/test_agreement.py"
        write_section(DOC, "tiny", render_matrix(RAN, "tiny random Llama (2 layers, hidden 256)", command))


@pytest.fixture(scope="module")
def calibration(tiny_llama_wide_dir):
    return calibration_for(AutoTokenizer.from_pretrained(tiny_llama_wide_dir))


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.long
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", [s.name for s in SCHEMES])
def test_every_side_agrees_on_every_pair_lmpress_writes(
    scheme, fmt, tiny_llama_wide_dir, calibration, tmp_path, agreement_doc
):
    outcome = check_pair(tiny_llama_wide_dir, scheme_named(scheme), fmt, calibration, tmp_path)
    agreement_doc.append(outcome)
    assert outcome.status in ("agree", "refused before work"), f"{outcome.status}: {outcome.detail}"
    if outcome.status == "agree":
        sides = {r.side for r in outcome.results}
        assert {"evaluator", "runtime"} <= sides
        assert any(r.side == "runtime" and r.against == "evaluator" for r in outcome.results)


def w8a8_export(model_dir: Path, calibration, tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    from lmpress.registry import exporter

    candidate = build_candidate(model_dir, scheme_named("W8A8 int8 (SmoothQuant)"), calibration, tmp_path / "state")
    out = tmp_path / "ct"
    out.mkdir()
    exporter("compressed-tensors")(candidate, AutoTokenizer.from_pretrained(model_dir), out)
    return out, candidate


def test_runtime_runs_the_w8a8_export_as_the_evaluator_does(tiny_llama_wide_dir, calibration, tmp_path):
    """The W8A8 defect: the runtime read the int8 codes under ``L.weight`` as float weights (garbage out)."""
    from lmpress.export.formats import load_quantized_model
    from lmpress.runtime.text import load_runtime

    out, candidate = w8a8_export(tiny_llama_wide_dir, calibration, tmp_path)
    runtime, _ = load_runtime(str(out))
    evaluator = load_quantized_model(out)
    ids = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5, 60, 61]])
    with torch.no_grad():
        got = runtime(ids, runtime.new_cache(1, ids.shape[1]))
        want = evaluator(ids).logits
        reference = candidate(ids).logits
    # per-token int8 activations: both run the same int8 GEMM, so only float32 rounding separates them
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(want, reference, atol=1e-5, rtol=0)


def run_w8a8_recipe(model_dir: Path, tmp_path: Path) -> tuple[int, dict]:
    import yaml

    from lmpress.cli import main

    recipe = {
        "model": str(model_dir),
        "data": {"source": "builtin:python-docs", "samples": 4, "seq_len": 64},
        "stages": [{"method": "smoothquant"}],
        "export": {"formats": ["compressed-tensors"]},
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 128, "windows": 2, "batch_size": 2}},
        "gates": ["ppl_ratio <= 1.5"],
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "run"
    code = main(["run", str(path), "--out", str(out), "--quiet"])
    return code, json.loads((out / "report.json").read_text())


def test_run_checks_the_runtime_on_its_shipped_export(tiny_llama_wide_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path / "cache"))
    code, report = run_w8a8_recipe(tiny_llama_wide_dir, tmp_path)
    assert code == 0
    agreement = report["runtime_agreement"]
    assert agreement["passed"] and agreement["format"] == "compressed-tensors"
    assert agreement["max_abs_diff"] <= agreement["tolerance"] and agreement["top1_agreement"] == 1.0


def test_run_whose_runtime_cannot_run_its_export_fails_its_gate(tiny_llama_wide_dir, tmp_path, monkeypatch):
    """A deliberately broken runtime path (the old W8A8 reading: codes under L.weight taken as dense)."""
    from lmpress.runtime.checkpoint import CheckpointModel

    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(CheckpointModel, "_is_dense", lambda self, name: f"{name}.weight" in self.files)
    code, report = run_w8a8_recipe(tiny_llama_wide_dir, tmp_path)
    assert code == 1
    assert not report["passed"] and not report["runtime_agreement"]["passed"]
    failed = [g for g in report["gates"] if not g["passed"]]
    assert [g["metric"] for g in failed] == ["runtime_compressed-tensors_max_logit_diff"]
    assert failed[0]["value"] > failed[0]["threshold"] and "top-1 agreement" in failed[0]["detail"]


def test_a_cuda_run_checks_its_runtime_on_the_gpu_in_bf16(tiny_llama_wide_dir, calibration, tmp_path, monkeypatch):
    """An H200 run of recipes/learned-w4-gpu.yaml spent 175 s building the CPU int8 kernels for this check:
    the runtime must load on the run's device, in the bf16 its CUDA kernels take, with no CPU kernel."""
    from lmpress.evals.agreement import check_runtime_agreement
    from lmpress.export.formats import load_quantized_model
    from lmpress.registry import exporter
    from lmpress.runtime import text
    from lmpress.runtime.kernels import cpu_int

    candidate = build_candidate(tiny_llama_wide_dir, scheme_named("W4 g32 sym"), calibration, tmp_path / "state")
    out = tmp_path / "gptq"
    out.mkdir()
    exporter("gptq")(candidate, AutoTokenizer.from_pretrained(tiny_llama_wide_dir), out)
    loads, real_load = [], text.load_runtime

    def load_on_the_cpu(source, device="cpu", dtype=None, cpu_activations="int8"):
        loads.append((str(device), dtype, cpu_activations))  # a CPU machine has no cuda to load onto
        return real_load(source, device="cpu", dtype=dtype, cpu_activations=cpu_activations)

    monkeypatch.setattr(text, "load_runtime", load_on_the_cpu)
    monkeypatch.setattr(cpu_int, "load_library", lambda: pytest.fail("the CPU kernels were built on a CUDA run"))
    window = torch.tensor([[1, 7, 42, 99, 3, 250, 17, 5, 60, 61]])
    agreement = check_runtime_agreement("gptq", out, load_quantized_model(out), window, "float32", device="cuda")
    assert loads == [("cuda", "bfloat16", "bf16")]
    assert agreement.passed and agreement.top1_agreement == 1.0


def test_reference_is_independent_of_the_export(tiny_llama_wide_dir, calibration, tmp_path):
    """The float reference runs the candidate's own weights in float64, not anything the writer produced."""
    from lmpress.evals.agreement_matrix import reference_model

    candidate = build_candidate(tiny_llama_wide_dir, scheme_named("W4 g32 sym"), calibration, tmp_path)
    reference = reference_model(candidate)
    ids = torch.tensor([[1, 7, 42, 99]])
    with torch.no_grad():
        torch.testing.assert_close(reference(ids).logits.float(), candidate(ids).logits, atol=1e-4, rtol=0)
    assert isinstance(reference, type(AutoModelForCausalLM.from_config(candidate.config)))
    assert all(p.dtype == torch.float64 for p in reference.parameters())
