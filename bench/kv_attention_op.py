"""The CPU cache-attention op alone (``lmpress_cpu::kv_slots_attention``), per layer at SmolLM2's shape (issue 50):
microseconds per call over float32 entries, int8, FP8 and INT4 codes (INT4 per token, and KIVI's keys per channel
and group of 32 slots with the unfinished group's float keys), for 1 to 4 query rows per KV head.

    python bench/kv_attention_op.py                       # 4,000 of 4,096 slots filled, 5 rounds
    python bench/kv_attention_op.py --isa 1 --rounds 3    # the AVX2 body on an AVX-512 host
    python bench/kv_attention_op.py --against HEAD~1      # today's op against a revision's, interleaved

Each call attends one query token of 3 x R heads over 3 KV heads of 64 (R = 3 is SmolLM2: 9 heads on 3), as the
compiled decode step calls it; the calls cycle through 30 layers' caches (184 MB in float32), so the caches come
from memory as in a decode step, not from the last-level cache. Rounds interleave the rows; each row's figure is
the median over rounds of the median call. ``GB/s``: the filled slots' bytes (codes and scales) over the time.
Results: ``bench/results/kv_attention_op.{json,md}``, one entry per host kind (a run replaces only its own).
``--against REV`` adds each row as ``cpu_kv_attention.cpp`` at that git revision computes it (built once into
lmpress's cache, its op under ``torch.ops.lmpress_cpu_base``), in the same rounds, prints today's time over the
revision's per row (the cache types that revision reads), and files nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_at_rev import build_at_rev  # noqa: E402
from runtime_hosts import cpu_identity, file_host_entry  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KV_HEADS, DIM = 3, 64
ISAS = {-1: "the op's best level for this CPU", 1: "its AVX2 body", 2: "its AVX-512 body"}


STORES = ("float32", "int8", "fp8", "int4", "int4-kivi")
EARLIER = ("float32", "int8", "fp8")  # what a revision before the INT4 op reads (``--against``)


def caches(stored: str, fill: int, layers: int, slots: int = 4096) -> list[tuple]:
    """Each layer's (keys, key scales, values, value scales, extra arguments) as the runtime's cache holds them
    (KIVI's keys: the float ring of the last slots and the step's slot)."""
    from lmpress.runtime.grouped_keys import RING
    from lmpress.weights.kv_quant import KVScheme, fp8_scale_from_amax, quantize_key_groups, quantize_kv

    g = torch.Generator().manual_seed(0)
    made = []
    for _ in range(layers):
        pair = []
        for _ in range(2):
            x = torch.randn(1, KV_HEADS, slots, DIM, generator=g)
            if stored == "float32":
                pair.append((x, None))
            elif stored == "int8":
                pair.append(quantize_kv(x, KVScheme("int8", "token")))
            elif stored.startswith("int4"):
                pair.append(quantize_kv(x, KVScheme("int4", "token")))
            else:
                scale = fp8_scale_from_amax(x[:, :, :fill].abs().amax(dim=(0, 2, 3)))
                pair.append(quantize_kv(x, KVScheme("fp8", "head"), scale))
        (k, ks), (v, vs) = pair
        extra = ()
        if stored == "int4-kivi":
            keys = torch.randn(1, KV_HEADS, slots, DIM, generator=g)
            k, ks = quantize_key_groups(keys)
            extra = (torch.randn(1, KV_HEADS, RING, DIM, generator=g), torch.tensor([fill - 1]))
        made.append((k, ks, v, vs, extra))
    return made


def filled_bytes(layer: tuple, fill: int) -> int:
    """The bytes of ``fill`` slots of a layer's codes, entries and scales that grow with the slots."""
    k, ks, v, vs, _ = layer
    grown = [t for t in (k, ks, v, vs) if t is not None and t.dim() >= 4]
    return sum(t.numel() * t.element_size() for t in grown) * fill // v.shape[2]


def time_row(layers: list[tuple], rows: int, fill: int, isa: int, calls: int, ops: str = "lmpress_cpu") -> float:
    """Median microseconds per call of ``calls`` calls cycling through the layers (the op of ``torch.ops.<ops>``)."""
    kv_slots_attention = getattr(torch.ops, ops).kv_slots_attention
    q = torch.randn(1, KV_HEADS * rows, 1, DIM, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(1, 1, 1, layers[0][0].shape[2], dtype=torch.bool)
    mask[..., :fill] = True
    times = []
    for i in range(calls):
        k, ks, v, vs, extra = layers[i % len(layers)]
        began = time.perf_counter()
        kv_slots_attention(q, k, ks, v, vs, mask, DIM**-0.5, isa, *extra)
        times.append(time.perf_counter() - began)
    return 1e6 * statistics.median(times)


def swapped_pairs(rows: list[dict]) -> list[dict]:
    """``rows`` with each of today's rows and the revision's row after it (``--against``) in the other order."""
    out = list(rows)
    for i in range(len(out) - 1):
        if not out[i]["at"] and out[i + 1]["at"]:
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


def render(hosts: dict) -> str:
    pages = ["Measured by `python bench/kv_attention_op.py` (us per call: one layer of a decode step).\n"]
    for key, entry in hosts.items():
        meta = entry["meta"]
        pages.append(
            f"## {key}\n\n{ISAS[meta['isa']]}, {meta['threads']} threads, {meta['fill']} of "
            f"{meta.get('slots', 4096)} slots filled, {meta['rounds']} rounds, {meta['when']}.\n"
        )
        pages.append("| cache | query rows per KV head | us per layer, median [min, max] over rounds | GB/s |")
        pages.append("| --- | --- | --- | --- |")
        for row in entry["rows"]:
            us = row["us"]
            pages.append(
                f"| {row['stored']} | {row['rows']} | {statistics.median(us):.0f} [{min(us):.0f}, {max(us):.0f}] "
                f"| {row['bytes'] / statistics.median(us) / 1e3:.1f} |"
            )
        pages.append("")
    return "\n".join(pages) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", type=int, default=-1, help="2 AVX-512, 1 AVX2, -1 the best this CPU runs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=150, help="calls per row and round (5 passes of 30 layers)")
    parser.add_argument("--fill", type=int, default=4000)
    parser.add_argument("--slots", type=int, default=4096, help="the cache's size (a decode step's max length)")
    parser.add_argument("--layers", type=int, default=30, help="caches to cycle through (SmolLM2's 30 layers)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--against", metavar="REV", help="also time the op at this git revision; file nothing")
    args = parser.parse_args(argv)
    from lmpress.runtime.kernels import cpu_kv_attention

    if not cpu_kv_attention.available():
        print("bench/kv_attention_op.py: the op is not built or this CPU has no AVX2 + FMA", file=sys.stderr)
        return 2
    isa = args.isa
    torch.set_num_threads(args.threads)
    stores = {name: caches(name, args.fill, args.layers, args.slots) for name in STORES}
    if args.against:
        build_at_rev(args.against, "cpu_kv_attention.cpp", "lmpress_cpu_base")
    kernels = {"lmpress_cpu": ""} | ({"lmpress_cpu_base": f" @{args.against}"} if args.against else {})
    rows = [
        {"stored": s, "rows": r, "us": [], "bytes": filled_bytes(stores[s][0], args.fill), "ops": ops, "at": at}
        for s in stores
        for r in args.rows
        for ops, at in kernels.items()
        if not at or s in EARLIER
    ]
    for round_ in range(args.rounds):
        # a revision's row and today's alternate which goes first: the second of a pair finds the caches the first
        # read partly in the last-level cache (int8's 49 MB on a 32 MB L3: 1.10x for the first with the same op)
        for row in rows if round_ % 2 == 0 else swapped_pairs(rows):
            row["us"].append(time_row(stores[row["stored"]], row["rows"], args.fill, isa, args.calls, row["ops"]))
        print(
            f"round {round_ + 1}/{args.rounds}: "
            + ", ".join(f"{r['stored']} R{r['rows']}{r['at']} {r['us'][-1]:.0f} us" for r in rows),
            flush=True,
        )
    if args.against:
        for now, then in zip(rows, rows[1:], strict=False):
            if now["at"] or not then["at"]:
                continue
            ratio = statistics.median(now["us"]) / statistics.median(then["us"])
            print(f"{now['stored']}, {now['rows']} row(s): now / {args.against} = {ratio:.3f}")
        return 0
    rows = [{k: v for k, v in row.items() if k not in ("ops", "at")} for row in rows]
    host = cpu_identity()
    meta = {
        "isa": isa,
        "threads": args.threads,
        "fill": args.fill,
        "slots": args.slots,
        "layers": args.layers,
        "rounds": args.rounds,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(file_host_entry(args.results / "kv_attention_op.json", host["key"], {"meta": meta, "rows": rows}, render))
    return 0


if __name__ == "__main__":
    sys.exit(main())
