"""INT8 / FP8 quality and speed table on SmolLM2-135M (issue 14, "Numbers"), written into the README.

    python bench/int8_table.py                     # every row, then bench/results/int8_table.md and README.md
    python bench/int8_table.py --rows w8a8-plain   # re-measure one row; the table keeps the others
    python bench/int8_table.py --reuse             # measure only rows not measured with these stages

Protocol: the one of bench/quant_table.py (its constants and CPU notes are imported):
calibration = 128 samples x 512 tokens of wiki.valid.tokens (seed 0); perplexity = first 20
non-overlapping 2048-token windows of wiki.test.raw (CRLF->LF, no BOS). Each row runs in its own
process: the stage runs on the FP32 model, the result is exported (compressed-tensors), read back
from disk by lmpress, and that artifact is scored, so the W8A8 rows score the int8 execution
(per-token int8 activations, torch._int_mm) of what ships.

The speed row times a 2048-token prefill (one forward pass, logits of the last position only, as
generation needs) of the W8A8 model against the FP32 model in the same process, 2 threads, median
of 5 runs each after a warm-up, and records the load average (the CPU may be shared).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_rows import copy_fp32_row, kept_rows, measure_in_child, publish, row_parser, wanted_rows  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lmpress, before an installed one
from quant_table import CALIBRATION, EVAL, REPO, SMOLLM2, WIKITEXT, cpu_description  # noqa: E402

RESULTS = REPO / "bench" / "results"
ROW_DIR = RESULTS / "int8_rows"
QUANT_TABLE_FP32 = RESULTS / "rows" / "fp32.json"
PREFILL_TOKENS = 2048
PREFILL_THREADS = 2
SPEED_GOAL = 1.5

# name -> (label, stage as a recipe writes it, export format of the scored artifact, ppl goal or None)
ROWS: dict[str, tuple[str, dict | None, str | None, float | None]] = {
    "fp32": ("FP32 (baseline)", None, None, None),
    "w8a8-sq-search-gptq": (
        "W8A8 SmoothQuant (alpha searched per pair) + GPTQ, per-channel W, per-token A",
        {"method": "smoothquant", "alpha_search": True, "rounding": "gptq"},
        "compressed-tensors",
        21.18,
    ),
    "w8a8-sq-gptq": (
        "W8A8 SmoothQuant (alpha 0.5) + GPTQ, per-channel W, per-token A",
        {"method": "smoothquant", "alpha": 0.5, "rounding": "gptq"},
        "compressed-tensors",
        None,
    ),
    "w8a8-plain-gptq": (
        "W8A8 without smoothing, GPTQ, per-channel W, per-token A",
        {"method": "smoothquant", "smooth": False, "rounding": "gptq"},
        "compressed-tensors",
        None,
    ),
    "w8a8-sq-rtn": (
        "W8A8 SmoothQuant (alpha 0.5) + RTN",
        {"method": "smoothquant", "alpha": 0.5},
        "compressed-tensors",
        None,
    ),
    "fp8-channel": (
        "FP8 W8A8 (E4M3, per-channel W, per-token A; simulated on CPU)",
        {"method": "fp8", "weights": "channel"},
        "compressed-tensors",
        21.10,
    ),
    "fp8-gptq": (
        "FP8 W8A8 (E4M3 per-channel W rounded by GPTQ, per-token A; simulated on CPU)",
        {"method": "smoothquant", "activations": "fp8", "smooth": False, "rounding": "gptq"},
        "compressed-tensors",
        21.10,
    ),
    "fp8-tensor": (
        "FP8 W8A8 (E4M3, per-tensor W, per-token A; simulated on CPU)",
        {"method": "fp8", "weights": "tensor"},
        "compressed-tensors",
        None,
    ),
    "bnb-llm-int8": (
        "LLM.int8 (bitsandbytes Linear8bitLt, threshold 6.0)",
        {"method": "llm_int8", "threshold": 6.0},
        "bitsandbytes",
        None,
    ),
    "bnb-nf4": (
        "NF4, double quant (bitsandbytes Linear4bit)",
        {"method": "bnb_4bit", "quant_type": "nf4", "double_quant": True},
        "bitsandbytes",
        None,
    ),
    "bnb-fp4": (
        "FP4, double quant (bitsandbytes Linear4bit)",
        {"method": "bnb_4bit", "quant_type": "fp4", "double_quant": True},
        "bitsandbytes",
        None,
    ),
}
# the row whose W8A8 model the prefill timing uses
SPEED_ROW = "w8a8-sq-gptq"


def prefill_seconds(model: Any, ids: Any, runs: int = 5) -> float:
    """Median wall time of one forward pass over ``ids`` keeping only the last position's logits."""
    import torch

    with torch.no_grad():
        model(ids, logits_to_keep=1, use_cache=False)
        times = []
        for _ in range(runs):
            began = time.perf_counter()
            model(ids, logits_to_keep=1, use_cache=False)
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure_row(name: str) -> dict:
    """Load SmolLM2, run row ``name``'s stage, export and read back the artifact, and score it."""
    import torch

    from lmpress.data import calibration_samples, load_text, token_windows, tokenize
    from lmpress.evals.perplexity import PerplexityConfig, perplexity
    from lmpress.loader import load_model
    from lmpress.registry import StageContext, exporter, stage_config, stage_handler_for

    torch.manual_seed(0)
    torch.set_num_threads(PREFILL_THREADS)
    label, stage, fmt, _ = ROWS[name]
    loaded = load_model(SMOLLM2)
    model, tokenizer = loaded.model, loaded.tokenizer
    summary, seconds, size = {}, None, None
    test_ids = tokenize(tokenizer, load_text(str(WIKITEXT / "wiki.test.raw")))
    windows = token_windows(test_ids, EVAL["seq_len"], EVAL["windows"])
    with tempfile.TemporaryDirectory() as work:
        if stage is not None:
            config = stage_config(stage["method"])(**stage)
            calib_ids = tokenize(tokenizer, load_text(str(WIKITEXT / "wiki.valid.tokens")))
            calibration = calibration_samples(calib_ids, **CALIBRATION)
            ctx = StageContext(
                calibration=lambda: calibration, state_dir=Path(work) / "state", resume=False, fingerprint=name
            )
            began = time.perf_counter()
            summary = stage_handler_for(config)(model, config, ctx)
            seconds = time.perf_counter() - began
            out = Path(work) / "artifact"
            out.mkdir()
            exporter(fmt)(model, tokenizer, out)
            size = sum(p.stat().st_size for p in out.rglob("*.safetensors"))
            del model, loaded
            model = load_model(str(out), fingerprint=False).model
        load_average = os.getloadavg()[0]
        result = perplexity(model, windows, PerplexityConfig(**EVAL, batch_size=1))
        speed = None
        if name == SPEED_ROW:
            ids = windows[:1, :PREFILL_TOKENS]
            w8a8 = prefill_seconds(model, ids)
            fp32 = prefill_seconds(load_model(SMOLLM2, fingerprint=False).model, ids)
            speed = {"w8a8_s": w8a8, "fp32_s": fp32, "speedup": fp32 / w8a8, "load_average": os.getloadavg()[0]}
    return {
        "row": name,
        "label": label,
        "stage": stage,
        "format": fmt,
        "ppl": result["ppl"],
        "seconds": seconds,
        "safetensors_bytes": size,
        "summary": summary,
        "prefill": speed,
        "load_average": load_average,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_description(),
    }


def render(rows: list[dict]) -> str:
    measured = {r["row"]: r for r in rows}
    base = measured.get("fp32", {}).get("ppl")
    lines = [
        "| scheme | ppl | delta vs FP32 | weights on disk (MB) | stage seconds | goal | met |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, (label, _, fmt, goal) in ROWS.items():
        r = measured.get(name)
        goal_text = "measured" if goal is None else f"ppl <= {goal}"
        if r is None:
            lines.append(f"| {label} | not measured | | | | {goal_text} | not measured |")
            continue
        delta = "" if base is None or name == "fp32" else f"{r['ppl'] - base:+.2f}"
        size = "" if not r.get("safetensors_bytes") else f"{r['safetensors_bytes'] / 1e6:.0f} ({fmt})"
        secs = "" if r.get("seconds") is None else f"{r['seconds']:.0f}"
        met = "" if goal is None else ("yes" if r["ppl"] <= goal else "NO")
        ppl = f"{r['ppl']:.2f}" if goal is None else f"{r['ppl']:.3f}"  # a goal's margin can be under 0.01
        lines.append(f"| {label} | {ppl} | {delta} | {size} | {secs} | {goal_text} | {met} |")
    speed = (measured.get(SPEED_ROW) or {}).get("prefill")
    goal_text = f">= {SPEED_GOAL}x faster"
    if speed is None:
        lines.append(f"| prefill of {PREFILL_TOKENS} tokens, W8A8 vs FP32 | not measured | | | | {goal_text} | |")
    else:
        met = "yes" if speed["speedup"] >= SPEED_GOAL else "NO"
        lines.append(
            f"| prefill of {PREFILL_TOKENS} tokens, W8A8 int8 matmul vs FP32, {PREFILL_THREADS} threads | "
            f"{speed['w8a8_s']:.2f} s vs {speed['fp32_s']:.2f} s: {speed['speedup']:.2f}x | | | | {goal_text} | {met} |"
        )
    notes = [
        "",
        f"SmolLM2-135M-Instruct (FP32), calibration {CALIBRATION['n_samples']} x {CALIBRATION['seq_len']} tokens of "
        f"wiki.valid.tokens (seed {CALIBRATION['seed']}), perplexity on the first {EVAL['windows']} windows of "
        f"{EVAL['seq_len']} tokens of wiki.test.raw (`python bench/int8_table.py`). Each quantized row is exported, "
        "read back from disk by lmpress and that artifact is scored: the W8A8 rows run int8 per-token activations "
        "through `torch._int_mm`. lm_head (tied to the embeddings) stays float. Sizes: the artifact's safetensors "
        "(the float embedding is 113 MB of them; FP32 is 538 MB).",
    ]
    cpus = sorted({r["cpu"] for r in rows if r.get("cpu")})
    if cpus:
        notes.append(f"CPU: {'; '.join(cpus)}, {os.cpu_count()} cores shared with other jobs.")
    loads = [f"{r['row']}: {r['load_average']:.1f}" for r in rows if r.get("load_average") is not None]
    if speed is not None:
        loads.append(f"prefill timing: {speed['load_average']:.1f}")
    if loads:
        notes.append(f"1-minute load average before each eval ({'; '.join(loads)}).")
    return "\n".join(lines + notes) + "\n"


def main() -> int:
    parser = row_parser(__doc__.splitlines()[0], ROWS, "keep rows measured before with the same stages")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_row(args.one)))
        return 0
    for name in copy_fp32_row(wanted_rows(parser, args.rows, ROWS), ROW_DIR, QUANT_TABLE_FP32):
        path = ROW_DIR / f"{name}.json"
        if args.reuse and path.exists() and json.loads(path.read_text()).get("stage") == ROWS[name][1]:
            continue
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        result = measure_in_child(__file__, "--one", name)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"  {name}: ppl {result['ppl']:.3f}  seconds {result['seconds']}", file=sys.stderr, flush=True)
    table = render(list(kept_rows(ROW_DIR, ROWS).values()))
    publish(table, RESULTS / "int8_table.md", ("int8-table", "INT8 and FP8 results"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
