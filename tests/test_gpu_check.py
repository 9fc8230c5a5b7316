"""bench/gpu_check.sh --dry-run: every step of the GPU visit, on the CPU at tiny sizes, says PASS, so that a
script error never costs device time; the two kernel tables (bench/triton_kernels.py, bench/runtime_gpu.py) write
their rows into the same results file."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {
    "smoke.environment",
    "smoke.tiny-model",
    *(
        f"smoke.stage.{k}"
        for k in (
            "rtn",
            "gptq",
            "awq",
            "smoothquant",
            "learned",
            "sparsegpt",
            "wanda",
            "magnitude",
            "structured",
            "fp8",
            "distill",
        )
    ),  # fmt: skip
    "smoke.recipe.gptq+distill+export",
    "smoke.recipe.fp8+export",
    "smoke.recipe.w4a8+export",
    "smoke.eval",
    "smoke.generate.eager",
    "smoke.generate.compiled",
    "smoke.generate.speculative",
    "smoke.generate.fp8",
    "smoke.generate.w4a8",
    "smoke.matmul.fp8",
    "smoke.matmul.int8",
    "smoke.tinygemm.layout",
    "smoke.onnx-runtime",
    "model.join",
    "model.learned-w4-gpu",
    "model.distill-speed.recover-24",
    "model.distill-speed.plain-bf16",
    "kernels",
    "fwht",
    "attention",
    "decode",
}


@pytest.mark.long
def test_the_dry_run_passes_every_step(tmp_path, cache_dir):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "LMPRESS_CACHE": str(cache_dir)}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    run = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    rows = [r for r in lines if "step" in r]
    tables = {r["bench"] for r in lines if "bench" in r}
    assert tables == {"triton_kernels", "runtime_gpu", "fwht", "decode_attention"}, tables
    printed = [line for line in run.stdout.splitlines() if re.match(r"(PASS|FAIL|SKIP) [^ ]+ \([0-9.]+ s\)", line)]
    # one printed line per JSON row, in the same order
    assert [line.split(" ")[:2] for line in printed] == [[r["status"], r["step"]] for r in rows]
    by_step = {r["step"]: r for r in rows}
    assert EXPECTED <= set(by_step), f"steps that never reported: {sorted(EXPECTED - set(by_step))}"
    for row in rows:
        if row["step"] == "smoke.onnx-runtime" and row["status"] == "SKIP":
            continue  # onnxruntime not installed here: said, not hidden
        if row["step"] == "smoke.tinygemm.layout" and row["status"] == "SKIP":
            continue  # torch packs tinygemm's layout on CUDA only (its transcription: test_int4pack_layout.py)
        assert row["status"] == "PASS", row
    assert by_step["model.learned-w4-gpu"]["ppl"] > 1
    assert by_step["model.distill-speed.plain-bf16"]["distill_over_plain"] > 0
