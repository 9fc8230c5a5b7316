"""The per-host probe of lmpress's CPU kernels, timed on SmolLM2-135M's weight shapes and its layers' cache (issue 55).

Runs ``kernels/cpu_probe.choose_int8_kernel`` (and ``choose_half_kernel``) on each weight shape and
``kv_attention_levels`` on SmolLM2's attention (3 KV heads of 64, 3 query rows each) with an empty tuning cache, as
the first load of a model on a new host does: how long the probe takes (the goal: <= 10 s for the model), what it
chose, and each candidate's time per product of one input row (per call of the cache attention op) beside the
default's. Results go to
``bench/results/cpu_probe.{json,md}``, one entry per host (``bench/runtime_hosts.py``'s name); a run replaces only
its own host's.

    python bench/cpu_probe.py [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_hosts import cpu_identity, file_host_entry  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# SmolLM2-135M's linear layers (hidden 576, 3 key-value heads of 64, feed-forward 1536, vocabulary 49152): W4 g64
# everywhere; the head 8-bit (bench/serve.py's --head w8 artifact) or bfloat16 (--head float --float-dtype bfloat16).
SHAPES = {
    "q, o (w4)": ("w4", 576, 576),
    "k, v (w4)": ("w4", 192, 576),
    "gate, up (w4)": ("w4", 1536, 576),
    "down (w4)": ("w4", 576, 1536),
    "head (w8)": ("w8", 49152, 576),
    "head (bf16)": ("half", 49152, 576),
}


def probe(kind: str, out: int, k: int) -> dict[str, Any]:
    from lmpress.runtime.kernels import cpu_half, cpu_int, cpu_probe

    recorded: dict[tuple[int, ...], float] = {}
    probed_with: list[Any] = []
    timer = cpu_probe.time_candidates

    def recording(*args: Any) -> dict[tuple[int, ...], float]:
        if not probed_with:  # the probe's first timing, of every candidate (a second confirms a challenger)
            probed_with.extend(args[:3])
        timed = timer(*args)
        for candidate, seconds in timed.items():
            recorded.setdefault(candidate, seconds)
        return timed

    cpu_probe.time_candidates = recording
    try:
        began = time.perf_counter()
        if kind == "half":
            choice = cpu_probe.choose_half_kernel(out, k, torch.bfloat16)
            default_prefetch, rows = cpu_probe.HALF_DEFAULT_PREFETCH, cpu_half.ROWS_PER_PASS
        else:
            kernel = cpu_int.W4A8Linear if kind == "w4" else cpu_int.W8A8RowLinear
            choice = cpu_probe.choose_int8_kernel(kernel, out, k, k // 64 if kind == "w4" else 1)
            default_prefetch, rows = cpu_probe.DEFAULT_PREFETCH, ()
        seconds = time.perf_counter() - began
    finally:
        cpu_probe.time_candidates = timer
    tried = cpu_probe.candidates(cpu_int.host_isa(), default_prefetch, rows)
    # The choice against the default (the host's best level, the op's own distance and rows), timed again side by side.
    chosen, default = tuple(choice.candidate()), tuple(tried[0])
    again = timer(*probed_with, [list(chosen), list(default)]) if chosen != default else {chosen: 1.0}
    return {
        "probe_s": seconds,
        "candidates": tried,
        "us": [1e6 * recorded[tuple(candidate)] for candidate in tried],
        "chosen": list(chosen),
        "speedup_over_default": again[default] / again[chosen],
    }


def probe_attention() -> dict[str, Any]:
    """The cache attention op's probe for SmolLM2's layers: its seconds, and per stored type the levels' times and
    the choice."""
    from lmpress.runtime.kernels import cpu_probe

    recorded: dict[str, dict[int, float]] = {}
    timer = cpu_probe.time_kv_attention

    def recording(*args: Any) -> dict[int, float]:
        timed = timer(*args)
        recorded.setdefault(args[3], timed)  # the probe's first timing (a second confirms a challenger)
        return timed

    cpu_probe.time_kv_attention = recording
    try:
        began = time.perf_counter()
        levels = cpu_probe.kv_attention_levels(3, 3, 64)
        seconds = time.perf_counter() - began
    finally:
        cpu_probe.time_kv_attention = timer
    return {
        "probe_s": seconds,
        "slots": cpu_probe.KV_PROBE_SLOTS,
        "chosen": dict(zip(cpu_probe.KV_STORED, levels, strict=True)),
        "us": {stored: {str(isa): 1e6 * t for isa, t in times.items()} for stored, times in recorded.items()},
    }


def label(candidate: list[int], tried: list[list[int]]) -> str:
    from lmpress.runtime.kernels import cpu_int

    isa, prefetch, *rows = candidate
    at_once = f", {rows[0]} row{'s' * (rows[0] > 1)} at once" if rows else ""
    return f"{cpu_int.ISA_NAMES[isa]}, {prefetch} B{at_once}" + (" (default)" if candidate == tried[0] else "")


def level_name(isa: int) -> str:
    from lmpress.runtime.kernels import cpu_int

    return "the best level (not probed)" if isa == -1 else cpu_int.ISA_NAMES[isa]


def render(hosts: dict[str, Any]) -> str:
    pages = [
        "Measured by `python bench/cpu_probe.py`: microseconds per product of one input row, for each candidate "
        "(instruction set level; prefetch distance the op's default, none, 1 KiB, 4x and 16x the default; the "
        "half-precision head, since 2026-12-04: weight rows at once, 4 or 1).\n"
    ]
    for key, entry in hosts.items():
        meta = entry["meta"]
        pages.append(
            f"## {key}\n\n{meta['threads']} threads, {meta['when']}, load average {meta['load']}; the probe of the "
            f"shapes below took **{meta['total_s']:.2f} s** together (a model probes its own: SmolLM2 W4 with one head "
            f"kind, {meta['model_s']:.2f} s at most).\n"
        )
        for shape, row in entry["shapes"].items():
            tried = row["candidates"]
            cells = ", ".join(f"{label(c, tried)} {us:.1f}" for c, us in zip(tried, row["us"], strict=True))
            pages.append(
                f"- **{shape}** (probe {row['probe_s']:.2f} s): chose {label(row['chosen'], tried)}, "
                f"{row['speedup_over_default']:.2f}x the default timed again beside it. {cells}"
            )
        attention = entry.get("attention")
        if attention:  # since 2026-12-04 (late): the cache attention op's level per stored type
            cells = "; ".join(
                f"{stored}: chose {level_name(level)} ("
                + ", ".join(f"{level_name(int(isa))} {us:.1f}" for isa, us in attention["us"].get(stored, {}).items())
                + ")"
                for stored, level in attention["chosen"].items()
            )
            pages.append(
                f"- **cache attention** (3 KV heads of 64, 3 rows each, {attention['slots']} slots of each stored "
                f"type; probe {attention['probe_s']:.2f} s), us per call: {cells}"
            )
        pages.append("")
    return "\n".join(pages) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from lmpress.runtime.kernels import cpu_int, tuning

    cpu_int.load_library()
    with tempfile.TemporaryDirectory() as empty:
        os.environ["LMPRESS_TUNE_CACHE"] = str(Path(empty) / "kernel_tuning.json")  # a first load on this host
        tuning.forget_in_memory()
        shapes = {name: probe(*shape) for name, shape in SHAPES.items()}
        attention = probe_attention()
    host = cpu_identity()
    meta = {
        "host": host,
        "threads": args.threads,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": f"{os.getloadavg()[0]:.2f}",
        "total_s": sum(row["probe_s"] for row in shapes.values()),
        "model_s": sum(row["probe_s"] for name, row in shapes.items() if "head" not in name)
        + max(row["probe_s"] for name, row in shapes.items() if "head" in name)
        + attention["probe_s"],
    }
    entry = {"meta": meta, "shapes": shapes, "attention": attention}
    print(file_host_entry(args.results / "cpu_probe.json", host["key"], entry, render))


if __name__ == "__main__":
    main()
