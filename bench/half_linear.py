"""One decode row through SmolLM2's head (49152 x 576) several ways, the weight streamed from memory (docs/runtime.md).

    python bench/half_linear.py                      # bench/results/half_linear.{json,md}: this host's entry
    python bench/half_linear.py --copies 2 --rounds 3  # quicker (the copies then partly fit the last-level cache)

- ``half_linear bf16`` / ``fp16``: lmpress's op (kernels/cpu_half.cpp), float32 row times the bfloat16 (float16)
  weight, float32 products; what a float32 build runs on a bfloat16 (float16) checkpoint's float layers. One row
  per instruction set this host runs (AVX2; AVX-512 where present), four weight rows at once (the op's default), and
  for bfloat16 one at a time (``1 row at once``: the other variant the per-host probe may choose).
- ``F.linear bf16``: torch's (oneDNN) bfloat16 row times the bfloat16 weight; what a bfloat16 build runs.
- ``F.linear fp32``: the float32 row times the weight widened to float32 (twice the bytes); what a float32 build
  ran before it kept bfloat16 weights.

Each way multiplies by ``--copies`` copies of the weight in turn (8 x 57 MB by default, past this Xeon's 300 MiB
L3), so each product reads its weight from memory; the ways alternate within each of ``--rounds`` rounds, and a
round's time is the median over its passes. GB/s = the weight's bytes / time per product. Each host kind (CPU model
and instruction sets) has its own entry in the results; a run replaces only its own host's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_hosts import cpu_identity, quartiles  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    from lmpress.runtime.kernels import cpu_half, cpu_int

    if not cpu_half.available():
        sys.exit("half_linear needs lmpress's C++ library and an AVX2 or AVX-512 CPU")
    torch.set_num_threads(args.threads)
    out_features, in_features = 49152, 576
    weights = [cpu_int.huge_pages(torch.randn(out_features, in_features).bfloat16()) for _ in range(args.copies)]
    halves = [cpu_int.huge_pages(w.half()) for w in weights]
    wide = [w.float() for w in weights]
    x = torch.randn(1, in_features)
    op = torch.ops.lmpress_cpu.half_linear
    ways = {}
    for isa in range(cpu_int.host_isa(), 0, -1):
        name = cpu_int.ISA_NAMES[isa]
        ways[f"half_linear bf16 {name}"] = lambda i, isa=isa: op(x, weights[i], isa)
        ways[f"half_linear bf16 {name}, 1 row at once"] = lambda i, isa=isa: op(x, weights[i], isa, 4608, 1)
        ways[f"half_linear fp16 {name}"] = lambda i, isa=isa: op(x, halves[i], isa)
    ways |= {
        "F.linear bf16": lambda i: F.linear(x.bfloat16(), weights[i]),
        "F.linear fp32": lambda i: F.linear(x, wide[i]),
    }
    nbytes = {name: weights[0].nbytes for name in ways} | {"F.linear fp32": wide[0].nbytes}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name, product in ways.items():
            passes = []
            for _ in range(3):
                began = time.perf_counter()
                for i in range(args.copies):
                    product(i)
                passes.append((time.perf_counter() - began) / args.copies)
            if round_:
                seconds[name].append(statistics.median(passes))
    rows = {}
    for name, times in seconds.items():
        low, median, high = quartiles([nbytes[name] / t / 1e9 for t in times])
        rows[name] = {"ms": 1e3 * statistics.median(times), "gb_s": median, "gb_s_q1": low, "gb_s_q3": high}
    host = cpu_identity()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    meta = {"host": host, "when": when, "copies": args.copies, "rounds": args.rounds, "threads": args.threads}
    for name, row in rows.items():
        row["mb"] = nbytes[name] / 1e6
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / "half_linear.json"
    hosts = json.loads(path.read_text()) if path.is_file() else {}
    if "meta" in hosts:  # the first, single-host file
        hosts = {hosts["meta"]["host"]["key"]: hosts}
    hosts[host["key"]] = {"meta": meta, "rows": rows}
    path.write_text(json.dumps(hosts, indent=2) + "\n")
    pages = [host_table(entry) for entry in hosts.values()]
    print(host_table(hosts[host["key"]]))
    (args.results / "half_linear.md").write_text("Measured by `python bench/half_linear.py`.\n\n" + "\n".join(pages))


def host_table(entry: dict) -> str:
    meta = entry["meta"]
    lines = [
        f"SmolLM2's head, 1 row, {meta['copies']} copies streamed, {meta['rounds']} rounds, {meta['threads']} "
        f"threads; {meta['host']['key']}, {meta['when']}.",
        "",
        "| way | weight MB | ms per product | GB/s, median [quartiles] |",
        "| --- | --- | --- | --- |",
    ]
    for name, row in entry["rows"].items():
        mb = row.get("mb", 113.2 if name == "F.linear fp32" else 56.6)  # the first file did not record it
        lines.append(
            f"| {name} | {mb:.1f} | {row['ms']:.2f} | {row['gb_s']:.1f} [{row['gb_s_q1']:.1f}, {row['gb_s_q3']:.1f}] |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
