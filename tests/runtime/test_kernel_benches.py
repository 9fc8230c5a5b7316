"""The two kernel benches a GPU visit runs (bench/gpu_check.sh), dry-run on the CPU: a script error must never
cost GPU time. Each prints every row as it ends and appends one JSON line per row to ``--results``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIELDS = {"name", "shape", "rows", "kernel"}


def start(script: str, results: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "LMPRESS_TUNE_CACHE": str(results) + ".tune"}
    return subprocess.Popen(
        [sys.executable, f"bench/{script}", "--dry-run", "--results", str(results)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def rows_of(results: Path) -> list[dict]:
    return [json.loads(line) for line in results.read_text().splitlines()]


def follow(process: subprocess.Popen, results: Path, into: dict) -> None:
    """Read ``process``'s output as it comes; note how many JSON rows were on disk when its first row showed."""
    lines, on_disk = [], None
    for line in process.stdout:
        lines.append(line)
        if on_disk is None and line.startswith(("w4_decode", "decode")):
            on_disk = len(results.read_text().splitlines())
    process.wait(timeout=300)
    into.update(out="".join(lines), code=process.returncode, rows=rows_of(results), on_disk=on_disk)


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """Both benches at once (~20 s each on 2 cores), each followed by its own thread."""
    folder = tmp_path_factory.mktemp("benches")
    runs, threads = {}, []
    for script in ("triton_kernels.py", "runtime_gpu.py"):
        results = folder / f"{script}.jsonl"
        results.write_text("")
        runs[script] = {}
        threads.append(threading.Thread(target=follow, args=(start(script, results), results, runs[script])))
        threads[-1].start()
    for thread in threads:
        thread.join(timeout=400)
    return {script: (r["out"], r["code"], r["rows"], r["on_disk"]) for script, r in runs.items()}


@pytest.mark.long
def test_triton_kernels_dry_run(dry_runs):
    out, code, rows, appended_when_printed = dry_runs["triton_kernels.py"]
    assert code == 0, out[-3000:]
    assert appended_when_printed >= 2  # the copy row and the first kernel row were on disk as it printed
    assert all(FIELDS <= row.keys() for row in rows)
    names = {row["name"] for row in rows}
    assert names == {"copy", "w4_decode", "w4_rows", "w4_prefill", "fp8_prefill", "w8_decode"}
    decode = [row for row in rows if row["name"] == "w4_decode"]
    assert {row["kernel"] for row in decode} == {"tinygemm (selected)", "triton"}  # as an H100 would select
    assert all(row["ok"] and row["us"] > 0 and row["ratio"] > 0 for row in decode)
    assert {row["rows"] for row in rows if row["name"] == "w4_rows"} == {4}
    fp8 = {row["kernel"]: row for row in rows if row["name"] == "fp8_prefill"}
    assert fp8["fp8-scaled-mm (selected)"]["reference"] == "cublas-bf16" and fp8["_scaled_mm only"]["ok"]
    assert len(out.splitlines()) >= len(rows)  # every row printed


def test_runtime_gpu_dry_run(dry_runs):
    out, code, rows, appended_when_printed = dry_runs["runtime_gpu.py"]
    assert code == 0, out[-3000:]
    assert appended_when_printed >= 2
    engine = ["decode", "reference", "profile", "profile"]
    assert [row["name"] for row in rows] == ["copy", *engine, *engine, "context", "context", "context", "generate"]
    bf16, w4 = rows[1], rows[5]
    assert bf16["kernel"].startswith("bf16 (dense x9)") and w4["kernel"].startswith("W4 g128 (cpu-w4a8 x8, dense x1)")
    assert w4["over_bf16"] == pytest.approx(w4["tok_s"] / bf16["tok_s"])
    for ours, theirs in ((bf16, rows[2]), (w4, rows[6])):  # lmpress against the reference timed beside it
        assert ours["reference"] == "gpt-fast-style" and ours["ratio"] == pytest.approx(ours["tok_s"] / theirs["tok_s"])
    assert w4["bytes_per_token"] < bf16["bytes_per_token"] / 2  # the W4 model reads its packed codes
    assert bf16["pct_copy"] == pytest.approx(100 * bf16["gb_s"] / rows[0]["gb_s"])
    assert w4["kernels"]["kernel of attention.wqkv"] == "cpu-w4a8 (2 layers)"
    for profile in (rows[3], rows[4], rows[7], rows[8]):
        assert 0 < len(profile["top"]) <= 15 and profile["launches_per_token"] > 0
        assert profile["kernel_us_per_token"] >= sum(k["us"] for k in profile["top"]) * (1 - 1e-9)
    # lmpress's W4 kernel ran: w4_linear_t16 on AVX-512 VNNI, w4_linear on AVX2 (the host's level, or the probe's)
    assert {k["kernel"] for k in rows[7]["top"]} & {"lmpress_cpu::w4_linear_t16", "lmpress_cpu::w4_linear"}
    assert {k["kernel"] for k in rows[8]["top"]} >= {"aten::_weight_int4pack_mm_for_cpu"}  # the reference's
    sweep = rows[9:12]
    assert [r["context"] for r in sweep] == [16, 32, 48] and sweep[0]["ratio"] == 1.0
    generated = rows[12]  # lmpress generate --compile's own loop on the W4 model, against the bench's step
    assert generated["kernel"] == "W4 g128 lmpress generate --compile" and generated["context"] == 48
    assert generated["tok_s"] > 0 and generated["ratio"] == pytest.approx(generated["tok_s"] / w4["tok_s"])


def test_the_gpt_fast_reference_computes_the_model():
    """The reference lmpress is timed against is the same model: its logits are transformers' for bf16 weights,
    and, for W4 codes run by tinygemm's CPU twin, the logits of transformers' forward over lmpress's
    ``QuantizedLinear`` (which dequantizes its codes): an engine that computed something cheaper would be no
    yardstick."""
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    import runtime_gpu
    from gpt_fast_reference import reference_from_hf

    args = runtime_gpu.arguments(["--dry-run"])
    hf = runtime_gpu.random_llama(args, torch.device("cpu"))
    with torch.no_grad():
        for part in ("q_proj", "k_proj"):  # wider than the init, so a wrong rope or mask shows in the logits
            for layer in hf.model.layers:
                getattr(layer.self_attn, part).weight.mul_(8)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    for quantized in (False, True):
        if quantized:
            runtime_gpu.quantize_w4(hf)
        reference = reference_from_hf(hf, torch.device("cpu"))
        reference.setup_caches(1, 16)
        with torch.no_grad():
            want = hf(ids).logits.float()
            prefill = reference(ids[:, :8], torch.arange(8)).float()
            steps = [reference(ids[:, i : i + 1], torch.tensor([i])).float() for i in range(8, 12)]
        got = torch.cat([prefill, *steps], 1)
        error = (got - want).norm() / want.norm()
        assert error < 0.03, (quantized, float(error))  # bf16 rounding of two different orders of operations


def test_bench_flags_are_checked():
    for script in ("triton_kernels.py", "runtime_gpu.py"):
        done = subprocess.run(
            [sys.executable, f"bench/{script}", "--tune", "huge"], cwd=REPO, capture_output=True, text=True
        )
        assert done.returncode == 2 and "--tune" in done.stderr


def test_the_gpu_only_selection_call_matches_the_selector(monkeypatch, tmp_path):
    """The kernel table's GPU branch asks the runtime's selector which kernel a layer gets; the dry run takes
    another branch, so an H200 visit was the first to find that call stale (a missing argument). Here the
    GPU branch runs against the selector's real signature."""
    import inspect

    import torch

    sys.path.insert(0, str(REPO / "bench"))
    import triton_kernels

    from lmpress.runtime.kernels import cuda

    real = cuda.cuda_kernel_name
    calls = []

    def checked(*args, **kwargs):
        inspect.signature(real).bind(*args, **kwargs)  # raises TypeError where the call is stale
        calls.append(args)
        return "tinygemm"

    monkeypatch.setattr(cuda, "cuda_kernel_name", checked)
    bench = triton_kernels.KernelBench(torch.device("cpu"), tmp_path / "rows.jsonl", dry_run=True)
    bench.dry_run = False  # as on a GPU: the selector is asked, not the table
    layer = triton_kernels.quantized_layer(64, 128, 4, 32, torch.device("cpu"))
    assert bench.selected(layer) == "tinygemm" and len(calls) == 1
