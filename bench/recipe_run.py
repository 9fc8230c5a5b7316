"""``lmpress run`` of a recipe from a benchmark, in its own process, reused when an earlier run holds the same
stages (bench/distill_table.py, bench/quant_table.py's recipe rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def normalized(stages: list[dict]) -> list[dict]:
    """Stages as their validated configs dump them (defaults filled in), for comparing two recipes."""
    from lmpress.registry import stage_config

    return [stage_config(s["method"])(**s).model_dump() for s in stages]


def lmpress_run(recipe: dict, out: Path, reuse: bool, threads: int) -> dict:
    """``lmpress run`` of ``recipe`` into ``out`` on ``threads`` CPU threads (reused when its report holds the
    same stages); its report. A failed gate (exit 1) is a result; any other failure ends the benchmark."""
    report_path = out / "report.json"
    if reuse and report_path.exists():
        report = json.loads(report_path.read_text())
        if normalized(report["recipe"]["stages"]) == normalized(recipe["stages"]):
            return report
    out.parent.mkdir(parents=True, exist_ok=True)
    recipe_path = out.parent / f"{out.name}.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "lmpress.cli", "run", str(recipe_path), "--out", str(out), "--overwrite"]
    done = subprocess.run(command, cwd=REPO, env=env, check=False)
    if done.returncode not in (0, 1):
        sys.exit(f"{recipe_path}: lmpress run exited {done.returncode}")
    return json.loads(report_path.read_text())
