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
    ("W8A8 int8, rotated with R4 (rotate + SmoothQuant)", "compressed-tensors"): "hadacore_transform",
}
# on an AVX2-only x86 CPU its WNA16 kernel is missing: every 4-bit weight-only export loads, then fails to run
NO_WNA16 = {
    ("W4 g32 sym", "gptq"),
    ("W4 g32 sym", "awq"),
    ("W4 g32 asym", "awq"),
    ("W4 g32 sym", "compressed-tensors"),
    ("W4 g32 asym", "compressed-tensors"),
    ("2:4 sparse + W4 g32 (SparseGPT)", "compressed-tensors"),
    ("W4A8 g64, int8 activations (RTN)", "compressed-tensors"),
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


@pytest.mark.long
@pytest.mark.parametrize(("scheme", "fmt"), VLLM_PAIRS)
def test_vllm_runs_each_export_as_lmpress_does_or_refuses_what_inspect_predicts(scheme, fmt, vllm_outcomes):
    outcome = vllm_outcomes[(scheme, fmt)]
    if (scheme, fmt) in REFUSED:
        assert outcome.status == "refused by vllm", f"{outcome.status}: {outcome.detail}"
        assert REFUSED[(scheme, fmt)] in outcome.detail
        return
    assert outcome.status == "agree", f"{outcome.status}: {outcome.detail}"
    assert {(r.side, r.against) for r in outcome.results} == {("vllm", "reference"), ("vllm", "runtime")}


@pytest.mark.long
def test_vllm_runs_a_calibrated_fp8_kv_cache_export_where_its_cpu_build_can(tiny_llama_wide_dir, tmp_path):
    """A W8A8 export with a calibrated FP8 KV cache (kv_cache_scheme, k_scale / v_scale), given to vLLM with no
    flag: vLLM turns its FP8 cache on from the checkpoint and, on AVX-512 or AMX CPUs, agrees with lmpress's
    evaluator on the quantized cache; elsewhere it refuses the export, as ``lmpress inspect`` predicts."""
    from lmpress.evals.agreement import BFLOAT16_UNIT, compare, hf_side, logit_scale, read_side
    from lmpress.evals.agreement_matrix import build_candidate, encode_prompts, scheme_named
    from lmpress.evals.vllm_consumer import run_vllm, vllm_side
    from lmpress.export.consumers import vllm_cpu_runs_fp8_kv
    from lmpress.export.inspect import inspect_artifact
    from lmpress.quantize.kv_attention import attach_kv_quant, calibrate_kv_scales, kv_quantized
    from lmpress.registry import exporter
    from lmpress.weights.kv_quant import KVScheme

    if vllm_python() is None:
        pytest.skip("vLLM's environment is not installed (docs/serving.md; set LMPRESS_VLLM_PYTHON)")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_wide_dir)
    calibration = calibration_for(tokenizer)
    candidate = build_candidate(
        tiny_llama_wide_dir, scheme_named("W8A8 int8 (SmoothQuant)"), calibration, tmp_path / "state"
    )
    kv = calibrate_kv_scales(candidate, calibration, KVScheme("fp8", "tensor"))
    attach_kv_quant(candidate, kv)
    out = tmp_path / "export"
    out.mkdir()
    exporter("compressed-tensors")(candidate, tokenizer, out)
    prompts = encode_prompts(tokenizer)
    (answer,) = run_vllm([out], prompts, 8, tmp_path / "vllm")
    verdict = inspect_artifact(out)["vllm"]
    if not vllm_cpu_runs_fp8_kv():
        assert "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in answer["error"]
        assert verdict.startswith("refuses:") and "AVX-512 or AMX" in verdict
        return
    assert "error" not in answer, answer["error"]
    assert verdict.startswith("loads") and "kv-cache-dtype fp8" in verdict
    with kv_quantized(candidate, kv):
        evaluator = hf_side("evaluator", candidate, BFLOAT16_UNIT)
        want = read_side(evaluator, prompts, 8)
        side = vllm_side(answer, prompts, 2.0**-4)  # E4M3 keeps 3 mantissa bits
        got = read_side(side, prompts, 8)
        result = compare(side, got, evaluator, want, prompts, logit_scale(want), evaluator.logits)
    assert result.agrees, result
