"""Pruning quality table on SmolLM2-135M (issue 12, "Numbers"), written into the README.

    python bench/prune_table.py                        # every row, then bench/results/prune_table.md and README.md
    python bench/prune_table.py --rows wanda-50        # re-measure one row; the table keeps the others
    python bench/prune_table.py --reuse                # measure only rows not measured with these stages

Protocol: the one of bench/quant_table.py (its constants and CPU notes are imported):
calibration = 128 samples x 512 tokens of wiki.valid.tokens (seed 0); perplexity = first 20
non-overlapping 2048-token windows of wiki.test.raw (CRLF->LF, no BOS). Each row runs in its own
process; the stages run in order on the FP32 model, seconds are the stages' wall time.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_table import CALIBRATION, EVAL, REPO, SMOLLM2, WIKITEXT, cpu_description  # noqa: E402
from table_rows import copy_fp32_row, kept_rows, measure_in_child, publish, row_parser, wanted_rows  # noqa: E402

RESULTS = REPO / "bench" / "results"
ROW_DIR = RESULTS / "prune_rows"
W4 = {"bits": 4, "group_size": 64, "symmetric": True}

# name -> (label, stages as a recipe writes them)
ROWS: dict[str, tuple[str, list[dict]]] = {
    "fp32": ("FP32 (baseline)", []),
    "magnitude-50": ("50% unstructured, magnitude", [{"method": "magnitude", "sparsity": 0.5}]),
    "wanda-50": ("50% unstructured, Wanda", [{"method": "wanda", "sparsity": 0.5}]),
    "sparsegpt-50": ("50% unstructured, SparseGPT", [{"method": "sparsegpt", "sparsity": 0.5}]),
    "wanda-24": ("2:4, Wanda", [{"method": "wanda", "pattern": "2:4"}]),
    "sparsegpt-24-paper": (
        "2:4, SparseGPT as published (no exact re-solve)",
        [{"method": "sparsegpt", "pattern": "2:4", "reconstruct": False}],
    ),
    "sparsegpt-24": ("2:4, SparseGPT", [{"method": "sparsegpt", "pattern": "2:4"}]),
    "sparsegpt-24-w4": (
        "2:4 + W4 g64 in one SparseGPT pass",
        [{"method": "sparsegpt", "pattern": "2:4", "quantize": W4}],
    ),
    "sparsegpt-24-then-rtn-w4": (
        "2:4 SparseGPT, then RTN W4 g64",
        [{"method": "sparsegpt", "pattern": "2:4"}, {"method": "rtn", **W4}],
    ),
    "mlp-25": ("structured: 25% of MLP channels", [{"method": "structured", "mlp_channels": 0.25}]),
    "depth-4": ("structured: 4 of 30 layers", [{"method": "structured", "layers": 4}]),
}
# row -> the row whose model it continues from: measured in the same process, after that row is scored
CONTINUES = {"sparsegpt-24-then-rtn-w4": "sparsegpt-24"}
# FP32 is scored by bench/quant_table.py with this very protocol: its row is reused when present
QUANT_TABLE_FP32 = RESULTS / "rows" / "fp32.json"
# (row that must score lower or equal, row it is compared with, goal text) and absolute limits
ORDER_GOALS = [
    ("sparsegpt-50", "wanda-50", "SparseGPT <= Wanda at 50%"),
    ("wanda-50", "magnitude-50", "Wanda <= magnitude at 50%"),
    ("sparsegpt-24", "wanda-24", "SparseGPT 2:4 below Wanda 2:4"),
    ("sparsegpt-24-w4", "sparsegpt-24-then-rtn-w4", "one pass below 2:4 then RTN W4"),
]
PPL_LIMITS = {"sparsegpt-24": 54.9}


def measure_rows(names: list[str]) -> list[dict]:
    """Load SmolLM2 once and measure ``names`` in order, each continuing from the model the one before it
    left (a chain of ``CONTINUES``; runs in a child process)."""
    import torch

    from lmpress.data import calibration_samples, load_text, tokenize
    from lmpress.loader import load_model
    from lmpress.prune.structured import parameter_bytes

    torch.manual_seed(0)
    loaded = load_model(SMOLLM2)
    model, tokenizer = loaded.model, loaded.tokenizer
    before = parameter_bytes(model)
    calib_ids = tokenize(tokenizer, load_text(str(WIKITEXT / "wiki.valid.tokens")))
    calibration = calibration_samples(calib_ids, **CALIBRATION)
    results, done, seconds = [], [], 0.0
    for name in names:
        stages = ROWS[name][1][len(done) :]
        result = measure_row(name, model, tokenizer, calibration, stages, before, seconds)
        done, seconds = ROWS[name][1], result["seconds"] or 0.0
        results.append(result)
    return results


def measure_row(
    name: str,
    model: Any,
    tokenizer: Any,
    calibration: Any,
    stages: list[dict],
    before: tuple[int, int],
    seconds: float,
) -> dict:
    """Run ``stages`` on ``model`` and score it as row ``name``; ``seconds`` spent on the stages before."""
    import torch

    from lmpress.data import load_text, token_windows, tokenize
    from lmpress.evals.perplexity import PerplexityConfig, perplexity
    from lmpress.prune.structured import parameter_bytes
    from lmpress.registry import StageContext, stage_config, stage_handler_for

    label = ROWS[name][0]
    params_before, bytes_before = before
    summaries = []
    for index, stage in enumerate(stages):
        config = stage_config(stage["method"])(**stage)
        with tempfile.TemporaryDirectory() as state_dir:
            ctx = StageContext(
                calibration=lambda: calibration, state_dir=Path(state_dir), resume=False, fingerprint=f"{name}{index}"
            )
            began = time.perf_counter()
            summaries.append(stage_handler_for(config)(model, config, ctx))
            seconds += time.perf_counter() - began
    params_after, bytes_after = parameter_bytes(model)
    zeros = total = 0
    for module in model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            zeros += int((module.weight == 0).sum())
            total += module.weight.numel()
        elif hasattr(module, "dequantized_weight"):
            w = module.dequantized_weight(torch.float32)
            zeros += int((w == 0).sum())
            total += w.numel()
    load_average = os.getloadavg()[0]
    test_ids = tokenize(tokenizer, load_text(str(WIKITEXT / "wiki.test.raw")))
    windows = token_windows(test_ids, EVAL["seq_len"], EVAL["windows"])
    result = perplexity(model, windows, PerplexityConfig(**EVAL, batch_size=1))
    for summary in summaries:  # long per-layer lists stay out of the row file
        summary.pop("angular_distance", None)
    return {
        "row": name,
        "label": label,
        "stages": ROWS[name][1],
        "ppl": result["ppl"],
        "seconds": seconds if ROWS[name][1] else None,
        "decoder_linear_sparsity": zeros / total if total else 0.0,
        "parameters_before": params_before,
        "parameters_after": params_after,
        "bytes_before": bytes_before,
        "bytes_after": bytes_after,
        "summaries": summaries,
        "load_average": load_average,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_description(),
    }


def goal_lines(measured: dict[str, dict]) -> dict[str, str]:
    """Per row: the goals it takes part in and whether each is met."""
    goals: dict[str, list[str]] = {name: [] for name in ROWS}
    for low, high, text in ORDER_GOALS:
        if low in measured and high in measured:
            met = measured[low]["ppl"] <= measured[high]["ppl"]
            goals[low].append(f"{text}: {'yes' if met else 'NO'}")
    for name, limit in PPL_LIMITS.items():
        if name in measured:
            goals[name].append(f"ppl <= {limit}: {'yes' if measured[name]['ppl'] <= limit else 'NO'}")
    return {name: "; ".join(lines) for name, lines in goals.items()}


def render(rows: list[dict]) -> str:
    measured = {r["row"]: r for r in rows}
    base = measured.get("fp32", {}).get("ppl")
    goals = goal_lines(measured)
    lines = [
        "| scheme | ppl | delta vs FP32 | sparsity of decoder linears | parameters (M) | size (MB) | seconds | goals |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, (label, _) in ROWS.items():
        r = measured.get(name)
        if r is None:
            lines.append(f"| {label} | not measured | | | | | | {goals[name]} |")
            continue
        delta = "" if base is None or name == "fp32" else f"{r['ppl'] - base:+.2f}"
        if "parameters_after" not in r:  # the FP32 row of quant_table.py, which does not count them
            params = size = ""
        else:
            params = f"{r['parameters_after'] / 1e6:.1f}"
            size = f"{r['bytes_after'] / 1e6:.0f}"
        if params and r["parameters_after"] != r["parameters_before"]:
            params = f"{r['parameters_before'] / 1e6:.1f} -> {params}"
        if size and r["bytes_after"] != r["bytes_before"]:
            size = f"{r['bytes_before'] / 1e6:.0f} -> {size}"
        secs = "" if r.get("seconds") is None else f"{r['seconds']:.0f}"
        sparsity = f"{r['decoder_linear_sparsity']:.1%}" if "decoder_linear_sparsity" in r else ""
        lines.append(
            f"| {label} | {r['ppl']:.2f} | {delta} | {sparsity} | {params} | {size} | {secs} | {goals[name]} |"
        )
    notes = [
        "",
        f"SmolLM2-135M-Instruct (FP32), calibration {CALIBRATION['n_samples']} x {CALIBRATION['seq_len']} tokens of "
        f"wiki.valid.tokens (seed {CALIBRATION['seed']}), perplexity on the first {EVAL['windows']} windows of "
        f"{EVAL['seq_len']} tokens of wiki.test.raw (`python bench/prune_table.py`). Sizes are of the model in "
        "memory: float32 tensors, and for quantized linears their packed codes, scales and zeros (a pruned but "
        "dense layer keeps its size; the structured rows shrink). Parameters count a quantized linear's weights. "
        "Every linear of the decoder layers is pruned; embeddings and the tied head are not.",
    ]
    cpus = sorted({r["cpu"] for r in rows if r.get("cpu")})
    if cpus:
        notes.append(f"CPU: {'; '.join(cpus)}, {os.cpu_count()} cores shared with other jobs (seconds are noisy).")
    return "\n".join(lines + notes) + "\n"


def main() -> int:
    parser = row_parser(__doc__.splitlines()[0], ROWS, "keep rows measured before with the same stages")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_rows(args.one.split(","))))
        return 0
    wanted = copy_fp32_row(wanted_rows(parser, args.rows, ROWS), ROW_DIR, QUANT_TABLE_FP32, stages=[])
    todo = []
    for name in wanted:
        path = ROW_DIR / f"{name}.json"
        if args.reuse and path.exists() and json.loads(path.read_text()).get("stages") == ROWS[name][1]:
            continue
        todo.append(name)
    chains = []
    for name in todo:
        parent = CONTINUES.get(name)
        chain = next((c for c in chains if c[-1] == parent), None)
        if chain is not None:
            chain.append(name)
        else:
            chains.append([parent, name] if parent in ROWS and parent not in todo else [name])
    for chain in chains:
        print(f"measuring {', '.join(chain)} ...", file=sys.stderr, flush=True)
        for result in measure_in_child(__file__, "--one", ",".join(chain)):
            (ROW_DIR / f"{result['row']}.json").write_text(json.dumps(result, indent=2) + "\n")
            print(f"  {result['row']}: ppl {result['ppl']:.3f}  seconds {result['seconds']}", file=sys.stderr)
    table = render(list(kept_rows(ROW_DIR, ROWS).values()))
    publish(table, RESULTS / "prune_table.md", ("prune-table", "Pruning results"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
