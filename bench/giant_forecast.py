"""The memory forecast of GPTQ W4 g128 on today's giant models, from their published configs alone.

    python bench/giant_forecast.py          # bench/results/giant_forecast.{json,md}

Each shape in ``tests/data/giants`` (Llama-3-70B, Llama-3.1-405B, Qwen3-235B-A22B, DeepSeek-V3: config.json only,
no weights) is forecast by ``lmpress forecast``'s code for one recipe (bfloat16 safetensors source, GPTQ W4 g128
with lm_head left in bfloat16, calibration 128 x 2048 tokens in batches of 4, a compressed-tensors export and no
eval), launched as 1 and as 8 processes. Reported per shape and process count: the stages' phase of each process
(what a process other than the main one holds at most), its calibration part, and the main process's peak (the
export's read-back and the runtime agreement check, which hold the candidate whole: docs/scale.md).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
GIANTS = REPO / "tests" / "data" / "giants"
SHAPES = ("llama-3-70b", "qwen3-235b-a22b", "llama-3.1-405b", "deepseek-v3")
PROCESSES = (1, 8)
GIB = 1 << 30


def forecast(shape: str, processes: int) -> dict:
    from lmpress.memory_plan import forecast_checkpoint
    from lmpress.recipe import parse_recipe

    recipe = parse_recipe(
        yaml.safe_load(
            f"model: {{source: {GIANTS / shape}, dtype: bfloat16}}\n"
            "data: {source: builtin:wikitext2, samples: 128, seq_len: 2048}\n"
            "stages: [{method: gptq, bits: 4, group_size: 128, ignore: [lm_head]}]\n"
            "export: {formats: [compressed-tensors]}\n"
        )
    )
    plan = forecast_checkpoint(recipe, processes)
    stages = plan.phases["stages"]
    return {
        "shape": shape,
        "processes": processes,
        "stages_gib": sum(stages.values()) / GIB,
        "calibration_gib": stages["calibration"] / GIB,
        "main_peak_gib": plan.ram_bytes / GIB,
        "main_peak_phase": plan.phase,
        "line": plan.describe(),
    }


def render(rows: list[dict]) -> str:
    lines = [
        "| shape | processes | each process's stages (GiB) | of which calibration | main's peak (GiB) | phase |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['processes']} | {r['stages_gib']:.1f} | {r['calibration_gib']:.1f} | "
            f"{r['main_peak_gib']:.1f} | {r['main_peak_phase']} |"
        )
    import torch
    from quant_table import cpu_description

    from lmpress.calib.compute_dtype import has_16bit_matmul

    widened = (
        "it has no bfloat16 matrix unit, so the read-back and agreement forwards count a decoder layer or the "
        "output layer in float32 (calib.compute_dtype)"
        if not has_16bit_matmul(torch.bfloat16)
        else "it multiplies bfloat16 natively"
    )
    lines.append(
        f"\nGPTQ W4 g128, lm_head kept, calibration 128 x 2048 in batches of 4, bfloat16 source, compressed-tensors "
        f"export, no eval; forecast for this host's CPU ({cpu_description()}: {widened}); "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}."
    )
    return "\n".join(lines) + "\n"


def main() -> int:
    rows = [forecast(shape, n) for shape in SHAPES for n in PROCESSES]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "giant_forecast.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = render(rows)
    (RESULTS / "giant_forecast.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
