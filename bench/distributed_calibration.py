"""GPTQ W4 g64 on SmolLM2-135M calibrated by one process or spread over two (torchrun, gloo), 1 thread each.

    python bench/distributed_calibration.py              # bench/results/distributed_calibration.{json,md}

Both runs are the same recipe (calibration 128 x 512 tokens of wiki.valid.tokens, seed 0; GPTQ W4 g64 sym,
act-order with static groups, MSE scales; a short perplexity eval, so the stage's time is not the eval's) in fresh
processes with ``OMP_NUM_THREADS=1``: ``lmpress run`` alone, then ``torchrun --nproc-per-node 2 -m lmpress.cli
run``. Reported: the GPTQ stage's wall time from each report.json, its speed-up, the main process's stage peak RSS,
how many packed codes differ between the two exports and each candidate's perplexity (docs/scale.md).
"""

from __future__ import annotations

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
    "stages": [
        {
            "method": "gptq",
            "bits": 4,
            "group_size": 64,
            "symmetric": True,
            "act_order": True,
            "static_groups": True,
            "mse": True,
            "ignore": ["lm_head"],
        },
    ],  # fmt: skip
    "export": {"formats": ["compressed-tensors"]},
    "eval": {"text": "builtin:wikitext2:test", "perplexity": {"seq_len": 2048, "windows": 4}},
    "gates": ["ppl_ratio <= 2"],
}


def run(out: Path, recipe: Path, processes: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    lmpress = ["-m", "lmpress.cli", "run", str(recipe), "--out", str(out), "--quiet"]
    command = [sys.executable, *(launcher if processes > 1 else []), *lmpress]
    began = time.perf_counter()
    subprocess.run(command, env=env, check=True, cwd=REPO)
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


def differing_codes(a: Path, b: Path) -> tuple[int, int]:
    """(differing 4-bit codes, all codes) between two compressed-tensors exports' packed weights."""
    import torch
    from safetensors.torch import load_file

    one, two = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    differ = total = 0
    for key in (k for k in one if k.endswith("weight_packed")):
        nibbles = [torch.stack([(t >> (4 * i)) & 15 for i in range(8)], -1) for t in (one[key], two[key])]
        differ += int((nibbles[0] != nibbles[1]).sum())
        total += nibbles[0].numel()
    return differ, total


def render(rows: list[dict], differ: int, total: int) -> str:
    one = rows[0]["stage_seconds"]
    lines = [
        "| processes x threads | GPTQ stage s | speed-up | main's stage peak RSS (MB) | candidate ppl (4 x 2048) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['processes']} x 1 | {r['stage_seconds']:.0f} | {one / r['stage_seconds']:.2f}x | "
            f"{r['stage_peak_rss_mb']:.0f} | {r['ppl']:.3f} |"
        )
    lines += [
        "",
        f"Packed codes that differ between the two exports: {differ} of {total} ({100 * differ / total:.2f}%); "
        "group scales identical (static groups).",
        f"SmolLM2-135M-Instruct, calibration 128 x 512 (wiki.valid.tokens, seed 0); CPU: {cpu_description()}, "
        f"{os.cpu_count()} cores; 1-minute load average after each run: "
        + ", ".join(f"{r['load_average_after']:.1f}" for r in rows)
        + f"; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(tmp) / "recipe.yaml"
        recipe.write_text(yaml.safe_dump(RECIPE))
        rows = [run(Path(tmp) / f"p{n}", recipe, n) for n in (1, 2)]
        differ, total = differing_codes(*(Path(tmp) / f"p{n}" / "compressed-tensors" for n in (1, 2)))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "distributed_calibration.json").write_text(
        json.dumps({"rows": rows, "differing_codes": differ, "codes": total}, indent=2) + "\n"
    )
    table = render(rows, differ, total)
    (RESULTS / "distributed_calibration.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
