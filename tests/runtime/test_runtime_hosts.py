"""bench/runtime.py's bookkeeping: statistics over interleaved repeats, goals against the faster llama.cpp build,
results filed per host kind (another host's entry is never overwritten), thread counts capped at the cores."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import runtime_hosts  # noqa: E402


def sample(t1: float, tn: float, bw: float = 20.0) -> dict[str, float]:
    return {"t1": t1, "tn": tn, "bw": bw, "load": 1.0}


INFO = {"prompt_tokens": 128, "new_tokens": 65, "bytes_per_token": 100e6, "peak_memory_mb": 500.0}


def test_summary_takes_median_and_quartiles_of_the_per_repeat_rates():
    # decode rates (65 - 1) / (tn - t1): 64, 128, 32, 64, 256 tok/s
    samples = [sample(0.1, 1.1), sample(0.1, 0.6), sample(0.1, 2.1), sample(0.2, 1.2), sample(0.1, 0.35)]
    row = runtime_hosts.summarize(samples, 65, INFO)
    assert row["decode_tok_s"] == pytest.approx(64)
    assert (row["decode_tok_s_q1"], row["decode_tok_s_q3"]) == pytest.approx((64, 128))
    assert row["bandwidth_pct"] == pytest.approx(100 * 64 * 100e6 / 1e9 / 20.0)
    assert row["ttft_s"] == pytest.approx(0.1)


def test_goals_compare_with_the_faster_llama_cpp_build():
    def row(rate: float, q1: float | None = None) -> dict:
        return {
            "decode_tok_s": rate,
            "decode_tok_s_q1": q1 or rate,
            "bytes_per_token": 90e6,
            "bandwidth_gb_s": 20.0,
            "bandwidth_pct": 100 * rate * 0.09 / 20,
        }

    rows = {"lmpress-w4-head8-compile": row(150, 140), "llama.cpp-q4_1": row(100), "llama.cpp-q4_1-native": row(90)}
    labels = {name: name for name in rows}
    found = runtime_hosts.goals(rows, labels)
    assert found[0].startswith("lmpress-w4-head8-compile / llama.cpp-q4_1 (the faster llama.cpp build): 1.50x")
    assert "1.40x at its slower quartile" in found[0]
    rows["llama.cpp-q4_1"] = row(float("nan"))  # a build whose repeats all failed to time is not the reference
    assert "/ llama.cpp-q4_1-native (the faster llama.cpp build): 1.67x" in runtime_hosts.goals(rows, labels)[0]


def test_a_host_files_its_own_entry_and_keeps_the_others(tmp_path):
    path = tmp_path / "runtime.json"
    labels = {"llama.cpp-q4_1": "llama.cpp Q4_1"}
    rows = {"llama.cpp-q4_1": runtime_hosts.summarize([sample(0.1, 1.1)] * 5, 65, INFO)}
    entry = {"meta": {"threads": 2, "repeats": 5}, "rows": rows, "goals": []}
    runtime_hosts.record(path, {"key": "CPU A [AVX2]"}, entry, labels)
    runtime_hosts.record(path, {"key": "CPU B [AVX2, AVX-512]"}, entry, labels)
    runtime_hosts.record(path, {"key": "CPU A [AVX2]"}, {**entry, "goals": ["rerun"]}, labels)
    hosts = json.loads(path.read_text())
    assert list(hosts) == ["CPU A [AVX2]", "CPU B [AVX2, AVX-512]"] and hosts["CPU A [AVX2]"]["goals"] == ["rerun"]
    page = path.with_suffix(".md").read_text()
    assert "## CPU A [AVX2]" in page and "## CPU B [AVX2, AVX-512]" in page and "| llama.cpp Q4_1 | 64.0 [" in page


def test_the_first_page_form_is_kept_as_its_own_host(tmp_path):
    path = tmp_path / "runtime.json"
    path.write_text(json.dumps({"meta": {"threads": 2}, "rows": {}, "goals": ["old"]}))
    runtime_hosts.record(path, {"key": "CPU A [AVX2]"}, {"meta": {}, "rows": {}, "goals": []}, {})
    hosts = json.loads(path.read_text())
    assert len(hosts) == 2 and any(entry["goals"] == ["old"] for entry in hosts.values())


def test_host_key_names_the_cpu_and_its_instruction_sets():
    host = runtime_hosts.cpu_identity()
    assert host["cpu_model"] and host["key"].startswith(host["cpu_model"]) and host["cores"] == os.cpu_count()


def test_threads_above_the_cores_warn_and_are_capped():
    import runtime

    with pytest.warns(UserWarning, match="more than this machine's"):
        assert runtime.capped_threads(os.cpu_count() + 3) == os.cpu_count()
    assert runtime.capped_threads(1) == 1


def test_workers_wait_as_libgomp_does_with_the_repository_first(tmp_path):
    env = runtime_hosts.worker_environment(
        {"PYTHONPATH": "/elsewhere", "OMP_WAIT_POLICY": "ACTIVE", "X": "1"}, tmp_path
    )
    assert "OMP_WAIT_POLICY" not in env  # libgomp's own policy (as users run it), whatever the caller's said
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere"] and env["X"] == "1"
    assert runtime_hosts.worker_environment({}, tmp_path)["PYTHONPATH"] == str(tmp_path)
    passive = runtime_hosts.worker_environment({"OMP_WAIT_POLICY": "ACTIVE"}, tmp_path, "PASSIVE")
    assert passive["OMP_WAIT_POLICY"] == "PASSIVE"  # asked for: threads sleep at once on a loaded machine


def test_warm_up_rounds_are_run_first_and_not_counted():
    rounds = runtime_hosts.round_orders(["a", "b", "c"], repeats=4, warmup=1)
    assert [counted for _, counted in rounds] == [False, True, True, True, True]
    assert [order[0] for order, _ in rounds] == ["a", "b", "c", "a", "b"]  # the first row rotates
    assert all(sorted(order) == ["a", "b", "c"] for order, _ in rounds)  # every row once per round
    assert [counted for _, counted in runtime_hosts.round_orders(["a"], repeats=2, warmup=0)] == [True, True]


def test_product_ratio_feeds_every_linear_its_own_width(monkeypatch):
    """bench/runtime.py's 4-row over 1-row product: every fused linear and the head, each with an input of its own
    in_features, also where the MLP is more than 8x the model's width (the inputs were column slices of one
    (rows, 8 x dim) tensor, too narrow for such a down projection)."""
    import runtime

    from lmpress.runtime.model import Transformer
    from tests.runtime.conftest import tiny_hf_model

    model = Transformer.from_hf(tiny_hf_model("llama", hidden_size=32, intermediate_size=320))
    linears = runtime.product_layers(model)
    seen: list[tuple[int, ...]] = []
    for layer in linears:
        layer.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    ratio = runtime.product_ratio(model, rows=4, repeats=1)
    widths = [getattr(la, "in_features", None) or la.parts[0].in_features for la in linears]
    assert 320 in widths and len(linears) == 2 * 4 + 1  # q/k/v, o, gate/up, down per layer; the head
    expected = [(n, k) for _ in range(2) for n in (1, 4) for k in widths]
    assert seen == expected
    assert 0 < ratio < float("inf")


def test_after_first_timing_rates_the_tokens_after_the_first_of_one_run():
    """--timing after-first: (N - 1) over the time after the first token of one N-token run (a long prefill left
    out); t(1) is that run's first token; a row that cannot tell when its first token came times two runs."""
    import argparse
    import time

    import runtime

    samples = [{"t1": 9.0, "tn": 10.0, "after_first": 1.0, "bw": 20.0, "load": 1.0}] * 3
    row = runtime_hosts.summarize(samples, 65, INFO)
    assert row["decode_tok_s"] == pytest.approx(64) and row["ttft_s"] == pytest.approx(9.0)
    args = argparse.Namespace(timing="after-first", new_tokens=8)

    def run(n: int) -> float:
        time.sleep(0.05)  # the prefill
        first = time.perf_counter()
        time.sleep(0.01 * (n - 1))
        return first

    timed = runtime.time_generation(run, args)
    assert set(timed) == {"t1", "tn", "after_first"}
    assert timed["t1"] >= 0.05 and 0.07 <= timed["after_first"] < timed["tn"] - 0.05
    two_runs = runtime.time_generation(lambda n: time.sleep(0.01 * n), args)  # no first-token time: two runs
    assert set(two_runs) == {"t1", "tn"} and two_runs["tn"] > two_runs["t1"]


def test_the_recipes_bench_sets_the_forecast_against_the_measured_peaks(tmp_path):
    import shipped_recipes

    report = {
        "peak_rss_mb": 2000.0,
        "memory_forecast_phases_mb": {"stages": 1500.0, "candidate eval": 1800.0},
        "phases": {"candidate eval": {"seconds": 3.0, "peak_rss_mb": 1900.0}},
        "stages": [{"method": "rtn", "peak_rss_mb": 1200.0}],
    }
    rows = shipped_recipes.memory_rows(report)
    assert rows["forecast_peak_mb"] == 1800.0 and rows["forecast_over_measured"] == pytest.approx(0.9)
    assert rows["phases_measured_mb"] == {"candidate eval": 1900.0, "stage rtn": 1200.0}
    result = {"seconds": 90.0, "exit_code": 0, "log_lines": 12, "longest_silence_s": 31.0, "passed": True, **rows}
    page = shipped_recipes.render(
        {"cpu": {"threads": 2, "torch": "2", "when": "now", "recipes": {"quickstart": result}}}
    )
    assert "| `quickstart.yaml` | 1.5 min | 0 | PASS | 1800 | 2000 | 0.90 | 12 | 31 s |" in page
    report["gates"] = [
        {"metric": "accept_length", "value": 1.3125, "passed": True},
        {"metric": "runtime_compressed-tensors_max_logit_diff", "value": 0.01, "passed": True},
    ]
    scored = result | {"gates": shipped_recipes.gate_values(report)}
    page = shipped_recipes.render({"cpu": {"threads": 2, "torch": "2", "when": "now", "recipes": {"eagle-w4": scored}}})
    assert "| `eagle-w4.yaml` | 1.5 min | 0 | PASS (accept_length 1.312) | 1800 |" in page


def test_the_recipes_bench_times_the_silences_of_a_run_s_log(tmp_path, monkeypatch):
    """The longest gap between two lines of the run's output (and from the start, and after the last), measured as
    the lines come, with the output kept in the log file."""
    import shipped_recipes

    script = "import sys, time; print('a', flush=True); time.sleep(0.3); print('b', flush=True); sys.exit(3)"
    real_popen = shipped_recipes.subprocess.Popen
    monkeypatch.setattr(
        shipped_recipes.subprocess, "Popen", lambda command, **kw: real_popen([sys.executable, "-c", script], **kw)
    )
    result = shipped_recipes.run_recipe("quickstart", tmp_path / "out", tmp_path / "run.log")
    assert result["exit_code"] == 3 and result["log_lines"] == 2
    assert 0.3 <= result["longest_silence_s"] < result["seconds"] and result["silent_after"] == "a"
    assert (tmp_path / "run.log").read_text() == "a\nb\n"
