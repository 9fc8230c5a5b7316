"""vLLM as a tested consumer (issue 40 part 2): every export vLLM's loader knows, written by lmpress from a tiny
random Llama, is loaded by vLLM's CPU build in its own environment (no flags beyond the model directory), and
its logits and greedy tokens agree with the float reference and with lmpress's runtime; where vLLM refuses a
scheme, ``lmpress inspect`` said so beforehand. Writes its rows into docs/agreement.md.

Needs the vLLM environment (docs/serving.md): ``$LMPRESS_VLLM_PYTHON`` or /tmp/vllm-venv/bin/python.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from lmpress.evals.agreement_matrix import render_matrix, write_section
from lmpress.evals.vllm_consumer import VLLM_PAIRS, check_vllm_pairs, vllm_python
from lmpress.export.consumers import vllm_cpu_runs_wna16
from tests.evals.test_agreement import DOC
from tests.quantize.test_awq import calibration_for

# what vLLM 0.32's CPU build refuses, by its own messages (lmpress.export.consumers predicts each)
REFUSED = {
    ("W4 g32 asym", "gptq"): "sym=False",
    ("W8 g32 sym", "gptq"): "uint8b128",
    ("W8 g32 asym", "gptq"): "sym=False",
    ("W4 g32 act-order (GPTQ)", "gptq"): "desc_act",
    ("W8 g32 sym", "compressed-tensors"): "CPUWNA16",
    ("W8 g32 asym", "compressed-tensors"): "CPUWNA16",
    ("W4 g32 sym", "gguf"): "config",
}
# on an AVX2-only x86 CPU its WNA16 kernel is missing: every 4-bit weight-only export loads, then fails to run
NO_WNA16 = {
    ("W4 g32 sym", "gptq"),
    ("W4 g32 sym", "awq"),
    ("W4 g32 asym", "awq"),
    ("W4 g32 sym", "compressed-tensors"),
    ("W4 g32 asym", "compressed-tensors"),
    ("2:4 sparse + W4 g32 (SparseGPT)", "compressed-tensors"),
}
if not vllm_cpu_runs_wna16():
    REFUSED |= dict.fromkeys(NO_WNA16, "cpu_gemm_wna16")


@pytest.fixture(scope="module")
def vllm_outcomes(tiny_llama_wide_dir, tmp_path_factory):
    if vllm_python() is None:
        pytest.skip("vLLM's environment is not installed (docs/serving.md; set LMPRESS_VLLM_PYTHON)")
    calibration = calibration_for(AutoTokenizer.from_pretrained(tiny_llama_wide_dir))
    workdir = tmp_path_factory.mktemp("vllm")
    outcomes = check_vllm_pairs(tiny_llama_wide_dir, VLLM_PAIRS, calibration, workdir)
    command = "python -m pytest tests/evals/test_vllm_consumer.py"
    write_section(DOC, "vllm", render_matrix(outcomes, "tiny random Llama (2 layers, hidden 256), vLLM side", command))
    return {(o.scheme, o.format): o for o in outcomes}


@pytest.mark.parametrize(("scheme", "fmt"), VLLM_PAIRS)
def test_vllm_runs_each_export_as_lmpress_does_or_refuses_what_inspect_predicts(scheme, fmt, vllm_outcomes):
    outcome = vllm_outcomes[(scheme, fmt)]
    if (scheme, fmt) in REFUSED:
        assert outcome.status == "refused by vllm", f"{outcome.status}: {outcome.detail}"
        assert REFUSED[(scheme, fmt)] in outcome.detail
        return
    assert outcome.status == "agree", f"{outcome.status}: {outcome.detail}"
    assert {(r.side, r.against) for r in outcome.results} == {("vllm", "reference"), ("vllm", "runtime")}
