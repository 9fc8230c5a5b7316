"""bench/generate_speed.py and bench/cpu_probe.py: the generate bench reads the summary line `lmpress generate`
prints (eager and compiled, wrapped as the console wraps it), and the probe bench records a choice per shape."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import cpu_probe as cpu_probe_bench  # noqa: E402
import generate_speed  # noqa: E402

from lmpress.runtime.kernels import cpu_int, cpu_probe  # noqa: E402
from lmpress.runtime.text import GenerationResult  # noqa: E402


@pytest.mark.parametrize("compile_seconds", [0.0, 10.4])
def test_the_bench_reads_what_generate_prints(compile_seconds):
    result = GenerationResult(
        tokens=list(range(128)),
        prompt_tokens=140,
        seconds=2.5,
        load_seconds=0.9,
        compile_seconds=compile_seconds,
        first_token_seconds=0.25,
        since_start=2.4 + compile_seconds,
    )
    printed = result.summary() + "; on cpu (no CUDA GPU found)"
    wrapped = textwrap.fill(printed, 80)  # as rich's console wraps it at 80 columns (a pipe, a CI log)
    found = generate_speed.SUMMARY.search(" ".join(wrapped.split()))
    assert found is not None, printed
    assert float(found["since_start"]) == pytest.approx(2.4 + compile_seconds, abs=0.05)
    assert float(found["rate"]) == pytest.approx(result.decode_rate, abs=0.05)
    assert float(found["compile"] or 0) == pytest.approx(compile_seconds, abs=0.05)


@pytest.mark.skipif(not cpu_int.available(), reason="the C++ kernels do not build on this host")
def test_the_probe_bench_records_each_shapes_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("LMPRESS_TUNE_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(cpu_probe, "PROBE_BYTES", 2**20)
    monkeypatch.setattr(cpu_probe, "ROUNDS", 2)
    row = cpu_probe_bench.probe("w4", 1024, 576)
    tried = cpu_probe.candidates(cpu_int.host_isa())
    assert row["candidates"] == tried and row["chosen"] in tried and len(row["us"]) == len(tried)
    assert row["probe_s"] > 0 and row["speedup_over_default"] > 0
    assert "(default)" in cpu_probe_bench.label(tried[0], tried)
