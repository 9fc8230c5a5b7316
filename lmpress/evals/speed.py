"""Size on disk and decode speed of the model before and of each export after, on lmpress's runtime.

A recipe's ``speed:`` section asks for it::

    speed: {prompt_tokens: 128, new_tokens: 64, repeats: 3}

Each model (the baseline checkpoint as loaded, then every export as written) is loaded into the
runtime and timed by ``lmpress.runtime.throughput.benchmark``, the code behind ``lmpress bench``: decode
tok/s = (N - 1) / (t(N new tokens) - t(1)), medians of ``repeats``, greedy, the same prompt for all.
Sizes are every file in the model's directory (weights, config, tokenizer).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from pydantic import PositiveInt

from lmpress.registry import StrictConfig


class SpeedSpec(StrictConfig):
    prompt_tokens: PositiveInt = 128
    new_tokens: PositiveInt = 64
    repeats: PositiveInt = 3


def directory_mb(path: Path) -> float:
    """Megabytes (1e6 bytes) of every file under ``path`` (or of ``path`` itself, a file)."""
    if path.is_file():
        return path.stat().st_size / 1e6
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def measure(path: Path, spec: SpeedSpec) -> dict[str, Any]:
    """Decode speed of the model or export in ``path`` on the runtime (CPU, float32 activations)."""
    from lmpress.runtime.text import load_runtime
    from lmpress.runtime.throughput import BenchSettings, bench_prompt, benchmark

    model, tokenizer = load_runtime(str(path), device="cpu")
    prompt = bench_prompt(tokenizer, spec.prompt_tokens)
    result = benchmark(model, prompt, BenchSettings(new_tokens=spec.new_tokens, repeats=spec.repeats))
    del model, tokenizer
    gc.collect()
    plain = result["plain"]
    return {
        "decode_tok_s": plain["decode_tok_s"],
        "prefill_tok_s": plain["prefill_tok_s"],
        "peak_memory_mb": plain["peak_memory_mb"],
        "threads": result["threads"],
    }


def size_and_speed(
    baseline: tuple[str, Path], exports: list[tuple[str, Path]], spec: SpeedSpec, log=lambda message: None
) -> dict[str, Any]:
    """One row per model: ``baseline`` (its label and directory) first, then each ``(format, directory)``.

    Every row after the first carries its size and speed relative to the first: ``times_smaller``
    (baseline MB / its MB) and ``times_faster`` (its decode tok/s / the baseline's)."""
    rows = []
    for label, path in [baseline, *exports]:
        log(f"timing {label} on lmpress's runtime ({spec.new_tokens} new tokens, median of {spec.repeats})")
        rows.append({"model": label, "size_mb": directory_mb(path), **measure(path, spec)})
    first = rows[0]
    for row in rows[1:]:
        row["times_smaller"] = first["size_mb"] / row["size_mb"]
        row["times_faster"] = row["decode_tok_s"] / first["decode_tok_s"]
    return {"settings": spec.model_dump(), "device": "cpu", "rows": rows}


def speed_rows(section: dict[str, Any]) -> list[list[str]]:
    """model | size (MB) | x smaller | decode tok/s | x faster, for report.md and the console."""
    rows = []
    for row in section["rows"]:
        smaller = f"{row['times_smaller']:.2f}x" if "times_smaller" in row else ""
        faster = f"{row['times_faster']:.2f}x" if "times_faster" in row else ""
        rows.append([row["model"], f"{row['size_mb']:.1f}", smaller, f"{row['decode_tok_s']:.1f}", faster])
    return rows


SPEED_HEADER = ["model", "size on disk (MB)", "smaller", "decode tok/s", "faster"]
