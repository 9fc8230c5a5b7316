"""One-shot methods on SmolLM2-135M calibrated by one process or spread over two (torchrun, gloo), 1 thread each.

    python bench/distributed_calibration.py                          # GPTQ
    python bench/distributed_calibration.py --methods awq smoothquant sparsegpt learned
                                       # each method's entry in bench/results/distributed_calibration.{json,md}

Per method both runs are the same recipe (calibration 128 x 512 tokens of wiki.valid.tokens, seed 0; a short
perplexity eval, so the stage's time is not the eval's) in fresh processes with ``OMP_NUM_THREADS=1``:
``lmpress run`` alone, then ``torchrun --nproc-per-node 2 -m lmpress.cli run``. The methods: GPTQ W4 g64 sym
(act-order with static groups, MSE scales); AWQ W4 g64 sym (scale and clipping searches on 16 samples, RTN);
SmoothQuant W8A8 with its α searched; SparseGPT 30% with GPTQ W4 g64 rounding in the same pass; learned rounding
W4 g64 as recipes/learned-w4.yaml (RTN start, batches of 4 samples) cut to 6 steps a layer (its processes share
each step's samples and all-reduce every learnable tensor a step; on a 2-vCPU AVX2 EPYC one process took 1.8 min a
layer at 20 steps and about 1 min at 6, so its pair of runs takes about 50 minutes there). Reported: the
stage's wall time from each report.json, its speed-up, the main process's stage peak RSS, how many stored values
(packed codes, every float tensor) differ between the two exports and each candidate's perplexity (docs/scale.md).
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
from quant_table import SMOLLM2, cpu_description  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
RECIPE = {
    "model": {"source": SMOLLM2, "dtype": "float32"},
    "data": {"source": "builtin:wikitext2:valid", "samples": 128, "seq_len": 512, "seed": 0},
    "export": {"formats": ["compressed-tensors"]},
    "eval": {"text": "builtin:wikitext2:test", "perplexity": {"seq_len": 2048, "windows": 4}},
    "gates": ["ppl_ratio <= 2"],
}
W4 = {"bits": 4, "group_size": 64, "symmetric": True, "ignore": ["lm_head"]}
STAGES = {
    "gptq": {"method": "gptq", **W4, "act_order": True, "static_groups": True, "mse": True},
    "awq": {"method": "awq", **W4},
    "smoothquant": {"method": "smoothquant", "alpha_search": True, "ignore": ["lm_head"]},
    "sparsegpt": {"method": "sparsegpt", "sparsity": 0.3, "quantize": {"bits": 4, "group_size": 64}},
    "learned": {
        "method": "learned",
        **W4,
        "iterations": 6,
        "batch_size": 4,
        "init": "rtn",
        "full_range": True,
        "seed": 0,
    },
}


def run(out: Path, recipe: Path, processes: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    lmpress = ["-m", "lmpress.cli", "run", str(recipe), "--out", str(out), "--quiet"]
    command = [sys.executable, *(launcher if processes > 1 else []), *lmpress]
    began = time.perf_counter()
    done = subprocess.run(command, env=env, check=False, cwd=REPO)
    if done.returncode not in (0, 1):  # 1: the run finished and its gate failed (the bench times it all the same)
        raise subprocess.CalledProcessError(done.returncode, command)
    report = json.loads((out / "report.json").read_text())
    stage = report["stages"][0]
    return {
        "processes": processes,
        "stage_seconds": stage["seconds"],
        "wall_seconds": time.perf_counter() - began,
        "stage_peak_rss_mb": stage["peak_rss_mb"],
        "ppl": report["candidate"]["metrics"]["ppl"],
        "load_average_after": os.getloadavg()[0],
    }


def differing_values(a: Path, b: Path) -> tuple[int, int]:
    """(differing stored values, all values) between two compressed-tensors exports: packed 4-bit codes counted
    one by one, every other tensor element by element."""
    import torch
    from safetensors.torch import load_file

    one, two = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    differ = total = 0
    for key in one:
        x, y = one[key], two[key]
        if key.endswith("weight_packed"):
            x, y = (torch.stack([(t >> (4 * i)) & 15 for i in range(8)], -1) for t in (x, y))
        differ += int((x != y).sum())
        total += x.numel()
    return differ, total


def render(entries: dict[str, dict]) -> str:
    lines = [
        "| method | processes x threads | stage s | speed-up | main's stage peak RSS (MB) | candidate ppl (4 x 2048) "
        "| values differing between the two exports |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for method, entry in entries.items():
        one = entry["rows"][0]["stage_seconds"]
        for r in entry["rows"]:
            differ = f"{entry['differing']} of {entry['values']:,}" if r["processes"] > 1 else ""
            lines.append(
                f"| {method} | {r['processes']} x 1 | {r['stage_seconds']:.0f} | {one / r['stage_seconds']:.2f}x | "
                f"{r['stage_peak_rss_mb']:.0f} | {r['ppl']:.3f} | {differ} |"
            )
    lines.append("")
    for method, entry in entries.items():
        loads = ", ".join(f"{r['load_average_after']:.1f}" for r in entry["rows"])
        lines.append(
            f"- {method}: {entry['stage']}; CPU: {entry['cpu']}; 1-minute load average after each run: {loads}; "
            f"{entry['when']}."
        )
    lines.append("\nSmolLM2-135M-Instruct, calibration 128 x 512 (wiki.valid.tokens, seed 0).")
    return "\n".join(lines) + "\n"


def recorded() -> dict[str, dict]:
    """The entries recorded so far, by method (a file from before methods were recorded each is GPTQ's)."""
    path = RESULTS / "distributed_calibration.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if "methods" in data:
        return data["methods"]
    return {
        "gptq": {
            "rows": data["rows"], "differing": data["differing_codes"], "values": data["codes"],
            "stage": json.dumps(STAGES["gptq"]), "cpu": "AMD EPYC (avx2), 2 cores", "when": "2026-11-28 21:57 UTC",
        }
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", choices=sorted(STAGES), default=["gptq"])
    args = parser.parse_args()
    entries = recorded()
    for method in args.methods:
        with tempfile.TemporaryDirectory() as tmp:
            recipe = Path(tmp) / "recipe.yaml"
            recipe.write_text(yaml.safe_dump({**RECIPE, "stages": [STAGES[method]]}))
            rows = [run(Path(tmp) / f"p{n}", recipe, n) for n in (1, 2)]
            differ, total = differing_values(*(Path(tmp) / f"p{n}" / "compressed-tensors" for n in (1, 2)))
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        entries[method] = {
            "rows": rows, "differing": differ, "values": total, "stage": json.dumps(STAGES[method]),
            "cpu": f"{cpu_description()}, {os.cpu_count()} cores", "when": when,
        }  # fmt: skip
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "distributed_calibration.json").write_text(json.dumps({"methods": entries}, indent=2) + "\n")
        table = render(entries)
        (RESULTS / "distributed_calibration.md").write_text(table)
        print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
