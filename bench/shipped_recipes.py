"""Every shipped recipe run as a user runs it, its log going to a file: wall time, exit code, the memory forecast
against the measured peaks (the run's and each phase's), and the longest the log stayed silent (issue 54).

    python bench/shipped_recipes.py                       # the CPU recipes, fastest first
    python bench/shipped_recipes.py quickstart wanda-50   # some of them

Each recipe runs in its own process (``python -m lmpress.cli run recipes/NAME.yaml --out DIR``) with its
output to a file, as CI keeps it; the bench reads that output as it comes and times each line, so "the log
showed nothing for N s" is measured, not guessed. Results: ``bench/results/shipped_recipes.{json,md}``, one
entry per host kind (a run replaces only its own host's recipes). The forecast is the one the run itself printed
and wrote to report.json (``memory_forecast_phases_mb``); the measured peaks are report.json's (the process's
peak RSS, and each phase's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_hosts import cpu_identity, file_host_entry  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "shipped_recipes.json"
# The recipes a CPU runs in under an hour here, fastest first (learned-w4-gpu / learned-w3 are for a GPU).
CPU_RECIPES = [
    "quickstart",
    "eval_suite",
    "depth-25",
    "wanda-50",
    "sparsegpt-24",
    "w8a8-smoothquant",
    "awq-w4",
    "sparsegpt-24-w4",
    "nvfp4-w4a16",
    "nvfp4-w4a4-rotated",
    "eagle-w4",
    "learned-w4",
    "recover-24",
    "recover-w3",
    "draft-student",
    "gptq-w4",
    "kv-fp8",
]


def run_recipe(name: str, out: Path, log: Path) -> dict:
    """One ``lmpress run`` of ``recipes/NAME.yaml`` into ``out``, its output into ``log``; wall time, exit code and
    the longest gap between two lines of its output (from the start to the first line, and after the last)."""
    recipe = str(REPO / "recipes" / f"{name}.yaml")
    command = [sys.executable, "-m", "lmpress.cli", "run", recipe, "--out", str(out), "--overwrite"]  # a fresh run
    began = time.perf_counter()
    stamps, lines = [began], ["(the start)"]
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)

        def copy() -> None:
            for line in process.stdout:
                stamps.append(time.perf_counter())
                lines.append(line.strip())
                sink.write(line)
                sink.flush()

        reader = threading.Thread(target=copy)
        reader.start()
        code = process.wait()
        reader.join()
    ended = time.perf_counter()
    stamps.append(ended)
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    longest = max(range(len(gaps)), key=gaps.__getitem__)
    return {
        "seconds": ended - began,
        "exit_code": code,
        "log_lines": len(stamps) - 2,
        "longest_silence_s": gaps[longest],
        "silent_after": lines[longest],  # the line the longest silence followed
    }


def memory_rows(report: dict) -> dict:
    """The forecast against the measured peaks: the run's, and each phase's (stages under their own names)."""
    forecast = report.get("memory_forecast_phases_mb") or {}
    measured = {name: phase.get("peak_rss_mb") for name, phase in (report.get("phases") or {}).items()}
    for stage in report.get("stages", []):
        if stage.get("peak_rss_mb") is not None:
            measured[f"stage {stage.get('method', '?')}"] = stage["peak_rss_mb"]
    peak_forecast = max(forecast.values()) if forecast else None
    peak = report.get("peak_rss_mb")
    return {
        "forecast_peak_mb": peak_forecast,
        "measured_peak_mb": peak,
        "forecast_over_measured": peak_forecast / peak if peak_forecast and peak else None,
        "phases_forecast_mb": forecast,
        "phases_measured_mb": measured,
    }


def gate_values(report: dict) -> dict[str, float]:
    """Each recipe gate's metric and the value the run scored (the checks a run adds itself left out)."""
    return {g["metric"]: g["value"] for g in report.get("gates", []) if "metric" in g and g.get("value") is not None}


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def scored(result: dict) -> str:
    recipe_gates = {k: v for k, v in result.get("gates", {}).items() if not k.startswith(("export_", "runtime_"))}
    return "".join(f" ({k} {v:.4g})" for k, v in recipe_gates.items())


def render(hosts: dict) -> str:
    lines = ["# Shipped recipes as a user runs them (bench/shipped_recipes.py), one section per host kind", ""]
    for key, entry in hosts.items():
        lines += [f"## {key}", "", f"{entry['threads']} threads; torch {entry['torch']}; {entry['when']}", ""]
        lines += [
            "| recipe | wall | exit | gates | forecast peak MiB | measured peak MiB | forecast / measured | "
            "log lines | longest silence |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, r in entry["recipes"].items():
            ratio = r.get("forecast_over_measured")
            lines.append(
                f"| `{name}.yaml` | {r['seconds'] / 60:.1f} min | {r['exit_code']} | "
                f"{'PASS' if r.get('passed') else 'FAIL' if r.get('passed') is False else '-'}{scored(r)} | "
                f"{mib(r.get('forecast_peak_mb'))} | {mib(r.get('measured_peak_mb'))} | "
                f"{f'{ratio:.2f}' if ratio else '-'} | {r['log_lines']} | {r['longest_silence_s']:.0f} s |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", default=CPU_RECIPES, help="names in recipes/ (default: the CPU ones)")
    parser.add_argument("--keep", type=Path, help="keep each run's folder and log here (default: a temporary one)")
    args = parser.parse_args()
    unknown = [n for n in args.recipes if not (REPO / "recipes" / f"{n}.yaml").is_file()]
    if unknown:
        raise SystemExit(f"no such recipe in recipes/: {', '.join(unknown)}")
    import torch

    host = cpu_identity()
    existing = json.loads(RESULTS.read_text()).get(host["key"], {}) if RESULTS.is_file() else {}
    entry = {
        "threads": os.cpu_count(),
        "torch": torch.__version__,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": host,
        "recipes": dict(existing.get("recipes", {})),
    }
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        for name in args.recipes:
            out = root / name
            print(f"{name}: running (log {root / f'{name}.log'}) ...", file=sys.stderr, flush=True)
            result = run_recipe(name, out, root / f"{name}.log")
            if result["exit_code"] not in (0, 1):  # refused or crashed: no run to record (its report is not this run's)
                sys.exit(f"{name}: lmpress run exited {result['exit_code']}; see {root / f'{name}.log'}")
            report_path = out / "report.json"
            if report_path.is_file():
                report = json.loads(report_path.read_text())
                result |= memory_rows(report) | {"passed": report.get("passed"), "gates": gate_values(report)}
            result["load_average"] = os.getloadavg()[0]
            entry["recipes"][name] = result
            print(f"{name}: {json.dumps(result)}", file=sys.stderr, flush=True)
            print(file_host_entry(RESULTS, host["key"], entry, render))


if __name__ == "__main__":
    main()
