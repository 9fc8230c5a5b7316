"""One-row decode products of the FP4 CPU op against the W4 int8-activation op on the same 4-bit bytes (issue 49).

    python bench/fp4_kernel.py                  # bench/results/fp4_kernel.{json,md}
    python bench/fp4_kernel.py --rounds 3 --mib 32   # quicker

SmolLM2-135M's layer shapes (out x in: 576 x 576 as q and o, 1536 x 576 as gate and up, 576 x 1536 as down). Per
shape, one random weight is quantized to NVFP4 and MXFP4 (lmpress's RTN, ``quantize_weight_fp4``); the W4 rows
take the NVFP4 weight's very code bytes as 4-bit integers, with float32 scales and uint8 zero points per group:

- ``fp4 nvfp4`` / ``fp4 mxfp4``: ``torch.ops.lmpress_cpu.fp4_linear`` (``fp4_linear_t16`` on AVX-512 VNNI), int8
  activations per 4 values, E4M3 (E8M0) scale bytes per 16 (32) columns;
- ``w4 g64``: ``torch.ops.lmpress_cpu.w4_linear`` (``w4_linear_t16`` on AVX-512 VNNI), the same activations, groups
  of 64 columns: the speed reference. The op takes groups of 64k columns only, so no W4 g32 row runs on it;
- ``torch w4 g32``: ``_weight_int4pack_mm_for_cpu`` in groups of 32 (bfloat16 activations): what the runtime runs
  for W4 g32 today, for context.

Each way multiplies one float32 row by ``--mib`` MiB of copies of its weight in turn (past the last-level cache, so
each product streams its weight from memory, as a decode step does); the ways alternate within each of ``--rounds``
rounds (the first rotating; one warm-up round discarded), a round's time being the median of 3 passes. Twice:
``--threads`` threads (2) timed by the wall clock, then one thread timed by its CPU time, which a loaded host
disturbs less. Reported: the median time per product over the rounds and its quartiles, GB/s (the bytes the way
reads: codes, scales, zeros), and speed relative to ``w4 g64`` (its time / the way's: >= 0.9 is the goal); "all
three" sums the three shapes' times round by round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_hosts import cpu_identity, quartiles  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"576x576 (q, o)": (576, 576), "1536x576 (gate, up)": (1536, 576), "576x1536 (down)": (576, 1536)}
REFERENCE = "w4 g64"


def ways_for(out: int, k: int, copies: int) -> tuple[dict, dict]:
    """Per way: a function of (x, copy index) computing one product, and the bytes one product reads."""
    from lmpress.runtime.kernels import cpu_fp4, cpu_int
    from lmpress.weights.fp4 import Fp4Linear, quantize_weight_fp4
    from lmpress.weights.qlinear import int4pack_scale_and_zero
    from lmpress.weights.scheme import QuantScheme

    ops = torch.ops.lmpress_cpu
    w = torch.randn(out, k) * 0.02
    fp4 = {
        fmt: Fp4Linear.from_weight(quantize_weight_fp4(w, QuantScheme(4, block, True, fp4=fmt)))
        for fmt, block in (("nvfp4", 16), ("mxfp4", 32))
    }
    codes = fp4["nvfp4"].unpack().codes  # the W4 rows' codes: the same bytes
    fns, nbytes = {}, {}
    for fmt, layer in fp4.items():
        mods = [cpu_fp4.Fp4A8Linear.from_layers([layer]) for _ in range(copies)]
        nbytes[f"fp4 {fmt}"] = mods[0].codes.nbytes + mods[0].scales.nbytes
        if mods[0].isa == 2:
            fns[f"fp4 {fmt}"] = lambda x, i, m=mods: ops.fp4_linear_t16(
                x, m[i].codes, m[i].scales, m[i].row_scale, m[i].block, m[i].out_features
            )
        else:
            fns[f"fp4 {fmt}"] = lambda x, i, m=mods: ops.fp4_linear(
                x, m[i].codes, m[i].scales, m[i].row_scale, m[i].block, m[i].isa
            )
    scales, zeros = torch.rand(out, k // 64) * 0.01 + 0.001, torch.full((out, k // 64), 8.0)
    w4 = [cpu_int.W4A8Linear(codes, scales, zeros, None) for _ in range(copies)]
    nbytes[REFERENCE] = w4[0].codes.nbytes + w4[0].scales.nbytes + w4[0].zeros.nbytes
    fns[REFERENCE] = lambda x, i: w4[i].product(x)
    scales32, zeros32 = torch.rand(out, k // 32) * 0.01 + 0.001, torch.full((out, k // 32), 8.0)
    packed = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1) for _ in range(copies)
    ]
    scale_zero = int4pack_scale_and_zero(scales32, zeros32, 1)
    nbytes["torch w4 g32"] = packed[0].nbytes + scale_zero.nbytes
    fns["torch w4 g32"] = lambda x, i: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.bfloat16(), packed[i], 32, scale_zero
    )
    return fns, nbytes


def time_shape(fns: dict, k: int, copies: int, rounds: int, cpu_clock: bool) -> dict[str, list[float]]:
    """Seconds per product of each way, one value per round (the median of 3 passes over the copies)."""
    clock = time.thread_time if cpu_clock else time.perf_counter
    x = torch.randn(1, k)
    names = list(fns)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds + 1):  # the first round warms up
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            passes = []
            for _ in range(3):
                began = clock()
                for i in range(copies):
                    fns[name](x, i)
                passes.append((clock() - began) / copies)
            if round_:
                seconds[name].append(statistics.median(passes))
    return seconds


def summary(times: list[float], nbytes: float) -> dict[str, float]:
    q1, median, q3 = quartiles([1e6 * t for t in times])
    return {"us": median, "us_q1": q1, "us_q3": q3, "mb": nbytes / 1e6, "gb_s": nbytes / (median * 1e-6) / 1e9}


def measure(threads: int, cpu_clock: bool, rounds: int, mib: float) -> dict[str, dict[str, dict[str, float]]]:
    """Per shape (and all three summed round by round), per way: time per product and speed against w4 g64."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    rows: dict[str, dict[str, dict[str, float]]] = {}
    totals: dict[str, list[float]] = {}
    total_bytes: dict[str, float] = {}
    for label, (out, k) in SHAPES.items():
        copies = max(2, int(mib * 2**20 / (out * k / 2)))
        fns, nbytes = ways_for(out, k, copies)
        seconds = time_shape(fns, k, copies, rounds, cpu_clock)
        rows[label] = {name: summary(times, nbytes[name]) for name, times in seconds.items()}
        for name, times in seconds.items():
            totals[name] = [a + t for a, t in zip(totals.get(name, [0.0] * len(times)), times, strict=True)]
            total_bytes[name] = total_bytes.get(name, 0.0) + nbytes[name]
        del fns
    rows["all three"] = {name: summary(times, total_bytes[name]) for name, times in totals.items()}
    for ways in rows.values():
        for row in ways.values():
            row["speed_vs_w4_g64"] = ways[REFERENCE]["us"] / row["us"]
    return rows


def render(rows: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    lines = [
        "| layer | way | MB read | us per product, median [quartiles] | GB/s | speed vs w4 g64 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, ways in rows.items():
        for name, r in ways.items():
            lines.append(
                f"| {label} | {name} | {r['mb']:.3f} | {r['us']:.1f} [{r['us_q1']:.1f}, {r['us_q3']:.1f}] | "
                f"{r['gb_s']:.1f} | {r['speed_vs_w4_g64']:.2f}x |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--mib", type=float, default=96.0, help="MiB of weight copies per way and shape")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    from lmpress.runtime.kernels import cpu_fp4, cpu_int

    if not cpu_fp4.available():
        sys.exit("fp4_kernel needs lmpress's C++ library")
    host = cpu_identity()
    isa = cpu_int.ISA_NAMES[cpu_int.host_isa()]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    modes = {
        f"{args.threads} threads, wall clock": (args.threads, False),
        "1 thread, CPU time of the thread (steadier on a loaded host)": (1, True),
    }
    results, lines = {}, []
    for mode, (threads, cpu_clock) in modes.items():
        results[mode] = measure(threads, cpu_clock, args.rounds, args.mib)
        lines += [f"### {mode}", "", *render(results[mode]), ""]
    head = (
        f"One row, {args.mib:g} MiB of weight copies streamed per way and shape, {args.rounds} interleaved rounds, "
        f"{isa} path; {host['key']}, {when}; load average {' '.join(f'{v:.1f}' for v in _load())} at the end."
    )
    ways = (
        "Ways: `fp4 nvfp4` / `fp4 mxfp4`: `lmpress_cpu.fp4_linear` (`_t16` on AVX-512 VNNI), int8 activations per 4; "
        "`w4 g64`: `lmpress_cpu.w4_linear` (`_t16`) on the NVFP4 weight's own code bytes, groups of 64 (the op takes "
        "groups of 64k only, so no W4 g32 runs on it); `torch w4 g32`: `_weight_int4pack_mm_for_cpu`, groups of 32, "
        "bfloat16 activations (what the runtime runs for W4 g32)."
    )
    table = "\n".join([head, "", ways, "", *lines])
    print(table)
    args.results.mkdir(parents=True, exist_ok=True)
    info = {"host": host, "isa": isa, "when": when, "threads": args.threads, "rounds": args.rounds, "mib": args.mib}
    (args.results / "fp4_kernel.json").write_text(json.dumps({"info": info, "modes": results}, indent=2) + "\n")
    (args.results / "fp4_kernel.md").write_text(table)


def _load() -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ()


if __name__ == "__main__":
    main()
