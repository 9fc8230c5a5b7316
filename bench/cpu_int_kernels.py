"""lmpress's CPU int8-activation kernels against torch's packed bf16 kernels on SmolLM2's linear shapes.

    python bench/cpu_int_kernels.py [--threads 1] [--repeats 7] [--against REV] [--gathered]

One pass = every linear layer of SmolLM2-135M W4 g64 (30 layers of distinct random weights: q/k/v fused,
o, gate/up fused, down) plus the W8 head, as one decode step reads them (streamed from memory, not cached).
Times are CPU time of the calling thread (``time.thread_time``), the two kernels interleaved, medians and
quartiles over the repeats, for 1 and 4 input rows. Prints a table; writes nothing. ``--against REV`` adds the
kernels of ``cpu_int.cpp`` at git revision REV (built once into lmpress's cache under the op namespace
``lmpress_cpu_base``; weights in the natural layout where that revision has no outputs-in-lanes kernel),
timed interleaved with today's, the W4 layers and the W8 head apart as well (``--isa 1``: the AVX2 path).
``--gathered`` adds the W4 layers' pass twice more, interleaved: over copies whose buffers are gathered into one
block of huge pages (``cpu_int.gather_into_huge_pages``, as the runtime builds them) and over the buffers apart.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable

import torch
from kernel_at_rev import build_at_rev

from lmpress.runtime.kernels import cpu_int
from lmpress.weights.qlinear import int4pack_scale_and_zero

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer's products
LAYERS, VOCAB, DIM = 30, 49152, 576


def build(isa: int | None) -> tuple[list, list, dict]:
    torch.manual_seed(0)
    ours, theirs = [], []
    for _ in range(LAYERS):
        for out, k in SHAPES:
            codes = torch.randint(0, 16, (out, k), dtype=torch.uint8)
            scales, zeros = torch.rand(out, k // 64) * 0.01 + 0.001, torch.randint(0, 16, (out, k // 64)).float()
            module = cpu_int.W4A8Linear(codes, scales, zeros, None, isa)
            module.natural = (cpu_int.repack_w4(codes), scales, zeros.to(torch.uint8))  # for --against
            ours.append((module, k))
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
            theirs.append(((packed, int4pack_scale_and_zero(scales, zeros, 1)), k))
    codes = torch.randint(0, 256, (VOCAB, DIM), dtype=torch.uint8)
    scales, zeros = torch.rand(VOCAB, 1), torch.full((VOCAB, 1), 128.0)
    head = cpu_int.W8A8RowLinear(codes, scales, zeros, None, isa)
    head.natural = (codes, scales.reshape(-1), zeros.reshape(-1).to(torch.uint8))  # for --against
    heads = {"ours": head, "theirs": ((codes ^ 0x80).view(torch.int8), torch.rand(VOCAB).bfloat16())}
    return ours, theirs, heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--isa", type=int, choices=sorted(cpu_int.ISA_NAMES), help="a lower level than the host's")
    parser.add_argument("--against", metavar="REV", help="also time cpu_int.cpp at this git revision")
    parser.add_argument("--gathered", action="store_true", help="also the W4 layers gathered into huge pages")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ours, theirs, heads = build(args.isa)
    xs = {k: torch.randn(8, k) for k in (576, 1536)}

    def run_ours(rows: int) -> None:
        for module, k in ours:
            module(xs[k][:rows])
        heads["ours"](xs[DIM][:rows])

    def run_theirs(rows: int) -> None:
        for (packed, scale_zero), k in theirs:
            torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k][:rows].bfloat16(), packed, 64, scale_zero)
        torch.ops.aten._weight_int8pack_mm(xs[DIM][:rows].bfloat16(), *heads["theirs"])

    isa = cpu_int.host_isa() if args.isa is None else args.isa
    kernels = {f"lmpress int8 ({cpu_int.ISA_NAMES[isa]})": run_ours, "torch bf16 packed": run_theirs}
    if args.against:
        build_at_rev(args.against, "cpu_int.cpp", "lmpress_cpu_base")
        base, now = torch.ops.lmpress_cpu_base, torch.ops.lmpress_cpu
        flat = {(k, n): xs[k][:n].contiguous() for k in xs for n in (1, 4)}
        tiled_base = isa == 2 and hasattr(base, "w4_linear_t16")  # a revision with AVX-512's outputs-in-lanes W4
        tiled_head = isa == 2 and hasattr(base, "w8_linear_t16")

        def base_op(name: str):  # noqa: ANN202
            """The base revision's op ``name`` with its prefetch and per_token given where that revision has no
            default for them (since 2026-12-07: see cpu_int.cpp's op definitions)."""
            op = getattr(base, name)
            required = [a for a in op.default._schema.arguments if not a.has_default_value()]
            options = {"prefetch": cpu_int.DEFAULT_PREFETCH, "per_token": 0}
            return lambda *given: op(*given, *[options[a.name] for a in required[len(given) :]])

        def pass_of(ops, part: str):  # noqa: ANN001, ANN202
            def run(rows: int) -> None:
                if part == "w4" and ops is base and not tiled_base:  # the natural layout (cpu_int.repack_w4)
                    for module, k in ours:
                        base_op("w4_linear")(flat[k, rows], *module.natural, module.isa)
                elif part == "w4" and ops is base:
                    for module, k in ours:
                        base_op("w4_linear_t16")(
                            flat[k, rows], module.codes, module.scales, module.zeros, module.out_features
                        )
                elif part == "w4":
                    for module, k in ours:
                        module.product(flat[k, rows])
                elif ops is base and not tiled_head:
                    head = heads["ours"]
                    base_op("w8_linear")(flat[DIM, rows], *head.natural, head.isa)
                elif ops is base:
                    head = heads["ours"]
                    base_op("w8_linear_t16")(flat[DIM, rows], head.codes, head.scales, head.zeros, head.out_features)
                else:
                    heads["ours"].product(flat[DIM, rows])

            return run

        for part in ("w4", "w8"):
            kernels[f"{part} pass, {args.against}"] = pass_of(base, part)
            kernels[f"{part} pass, now"] = pass_of(now, part)
    if args.gathered:
        gathered = [(copy.deepcopy(module), k) for module, k in ours]
        cpu_int.gather_into_huge_pages(module for module, _ in gathered)

        def w4_pass(layers: list) -> Callable[[int], None]:
            def run(rows: int) -> None:
                for module, k in layers:
                    module.product(xs[k][:rows].contiguous())

            return run

        kernels |= {"w4 pass, buffers apart": w4_pass(ours), "w4 pass, gathered": w4_pass(gathered)}
    medians = {}
    print("| kernel | rows | ms per pass: median [quartiles] |\n|---|---|---|")
    for rows in (1, 4):
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for run in kernels.values():
            run(rows)  # warm-up
        for _ in range(args.repeats):
            for name, run in kernels.items():
                began = time.thread_time()
                run(rows)
                times[name].append(time.thread_time() - began)
        for name, samples in times.items():
            q1, q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
            medians[name, rows] = q2
            print(f"| {name} | {rows} | {q2 * 1e3:.1f} [{q1 * 1e3:.1f}, {q3 * 1e3:.1f}] |")
    for name in kernels:
        print(f"{name}: 4 rows take {medians[name, 4] / medians[name, 1]:.2f}x the time of 1")
    if args.against:
        for part in ("w4", "w8"):
            for rows in (1, 4):
                ratio = medians[f"{part} pass, now", rows] / medians[f"{part} pass, {args.against}", rows]
                print(f"{part} pass, {rows} row(s): now / {args.against} = {ratio:.3f}")
    if args.gathered:
        for rows in (1, 4):
            ratio = medians["w4 pass, gathered", rows] / medians["w4 pass, buffers apart", rows]
            print(f"w4 pass, {rows} row(s): gathered / apart = {ratio:.3f}")
    print(f"{args.threads} thread(s), load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
