"""Quantized matmul kernels at Llama-3-8B shapes: lmpress's selected kernel, its Triton kernels and gemlite
against torch's tinygemm and bf16 cuBLAS (issue 37's kernel goals). Every row prints the moment it ends.

    python bench/triton_kernels.py --results results.jsonl      # CUDA: the table, one JSON line per row
    python bench/triton_kernels.py --dry-run                    # tiny shapes on the CPU (Triton interpreted)

Rows (``--rows`` picks some):
  w4_decode   one activation row (a decode step), W4 g128 symmetric RTN, at 4096x4096 (o_proj),
              6144x4096 (q/k/v fused), 14336x4096 (gate or up), 28672x4096 (gate and up fused, as the
              runtime runs them) and 4096x14336 (down): each kernel against tinygemm
              (``_weight_int4pack_mm``); goal >= 1.0x at every shape for the selected kernel.
  w4_rows     2, 4 and 8 rows (a speculative round's verification) against bf16 cuBLAS; goal >= 1.0x.
  w4_prefill  2048 rows against bf16 cuBLAS (what a W4 layer costs in prefill; no goal).
  fp8_prefill FP8 W8A8, 2048 tokens: ``ScaledMMLinear`` (per-token E4M3 quantization + ``_scaled_mm``) and
              the bare ``_scaled_mm`` against bf16 cuBLAS; goal >= 1.3x.
  w8_decode   W8 per-channel, one row, lmpress Triton against bf16 cuBLAS.
``selected`` is the kernel ``lmpress.runtime.kernels.select`` picks for the layer on this GPU (a dry run
asks as if on an H100). Each kernel is checked against the float64 product of the dequantized weight
before it is timed (``sqnr_db``; ``ok`` is SQNR >= 40 dB). Times: ``triton.testing.do_bench`` medians
(it clears the L2 cache before every run, so weights come from HBM); GB/s counts the bytes the kernel
must read for its weight. ``ratio`` = reference time / kernel time (above 1: faster than the reference).
``--tune small`` (default) tunes lmpress's Triton kernels over a fixed few configs (``tuning.set_tune_space``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

SHAPES = [
    ("o_proj", 4096, 4096),
    ("qkv fused", 6144, 4096),
    ("gate, up", 14336, 4096),
    ("gate+up fused", 28672, 4096),
    ("down", 4096, 14336),
]
DRY_SHAPES = [("dry", 64, 128)]
FEW_ROWS, DRY_FEW_ROWS = (2, 4, 8), (4,)
PREFILL_TOKENS, DRY_PREFILL_TOKENS = 2048, 24
GROUP = 128
MIN_SQNR_DB = 40.0
ROWS = ("w4_decode", "w4_rows", "w4_prefill", "fp8_prefill", "w8_decode")


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="append one JSON line per row to this file")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, Triton interpreted")
    parser.add_argument("--tune", choices=("small", "full", "off"), default="small", help="Triton autotune space")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    args = parser.parse_args(argv)
    args.rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}: expected some of {', '.join(ROWS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    from lmpress.runtime.kernels.tuning import set_tune_space

    set_tune_space(args.tune)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("bench/triton_kernels.py needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    bench = KernelBench(torch.device("cpu" if args.dry_run else "cuda"), args.results, args.dry_run)
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    tokens = DRY_PREFILL_TOKENS if args.dry_run else PREFILL_TOKENS
    for row in args.rows:
        for role, n, k in shapes:
            if row == "w4_decode":
                bench.w4(role, n, k, rows=1, reference="tinygemm")
            elif row == "w4_rows":
                for rows in DRY_FEW_ROWS if args.dry_run else FEW_ROWS:
                    bench.w4(role, n, k, rows=rows, reference="cublas-bf16")
            elif row == "w4_prefill":
                bench.w4(role, n, k, rows=tokens, reference="cublas-bf16")
            elif row == "fp8_prefill":
                bench.fp8(role, n, k, rows=tokens)
            else:
                bench.w8(role, n, k)
    print(f"({time.time() - bench.began:.0f} s; {bench.failures} kernel(s) below {MIN_SQNR_DB} dB)", flush=True)
    return 1 if bench.failures else 0


class KernelBench:
    """Builds each layer, checks and times each kernel on it, and prints / appends each row as it ends."""

    def __init__(self, device, results: Path | None, dry_run: bool) -> None:
        import torch

        self.device, self.results, self.dry_run = device, results, dry_run
        self.began, self.failures = time.time(), 0
        self.torch = torch
        from lmpress.runtime.throughput import copy_bandwidth_gbs

        self.copy_gbs = copy_bandwidth_gbs(device, megabytes=16 if dry_run else 1024)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
        import triton

        print(f"{name}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
        self.emit({"name": "copy", "shape": "-", "rows": 0, "kernel": "copy_", "us": None, "gb_s": self.copy_gbs})

    # Rows ------------------------------------------------------------------------------------

    def emit(self, row: dict) -> None:
        row = {"bench": "triton_kernels", "device": str(self.device), **row}
        us = "" if row.get("us") is None else f"{row['us']:9.1f} us"
        gbs = "" if row.get("gb_s") is None else f"{row['gb_s']:7.0f} GB/s"
        ratio = "" if row.get("ratio") is None else f"{row['ratio']:.2f}x {row['reference']}"
        sqnr = "" if row.get("sqnr_db") is None else f"{row['sqnr_db']:.1f} dB{'' if row['ok'] else ' FAIL'}"
        line = f"{row['name']:<11} {row['shape']:<24} rows {row['rows']:<5} {row['kernel']:<28} {us:>12} {gbs:>12}"
        append_json_line(self.results, row)  # on disk before it shows: a killed run keeps every row it printed
        print(f"{line}  {ratio:<22} {sqnr}", flush=True)

    def kernel_row(self, name, shape, rows, kernel, run, reference_out, weight_bytes, reference) -> float | None:
        """Check ``run()`` against ``reference_out``, time it, emit the row; its time (None when it failed)."""
        try:
            out = run()
            sqnr = sqnr_db(reference_out, out)
            us = median_us(run, self.device, repeats=1 if self.dry_run else 5)
        except Exception as e:  # one kernel's failure is a row, not the end of the table
            self.failures += 1
            last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            self.emit({"name": name, "shape": shape, "rows": rows, "kernel": kernel, "error": last[:300]})
            return None
        ok = sqnr >= MIN_SQNR_DB
        self.failures += not ok
        row = {"name": name, "shape": shape, "rows": rows, "kernel": kernel, "us": us, "sqnr_db": sqnr, "ok": ok}
        row["gb_s"] = weight_bytes / us / 1e3 if weight_bytes else None
        if reference == 0:  # this kernel is its own reference
            row.update(reference=kernel.split()[0], reference_us=us, ratio=1.0)
        elif reference is not None:
            row.update(reference=reference[0], reference_us=reference[1], ratio=reference[1] / us)
        self.emit(row)
        return us

    def w4(self, role: str, n: int, k: int, rows: int, reference: str) -> None:
        torch = self.torch
        from lmpress.runtime.kernels import build_kernel

        layer = quantized_layer(n, k, 4, GROUP, self.device)
        x = torch.randn(rows, k, dtype=torch.bfloat16, device=self.device)
        expected = x.double() @ layer.dequantized_weight(torch.float64).T
        shape = f"{n}x{k} ({role})"
        name = {1: "w4_decode"}.get(rows, "w4_rows" if rows <= 8 else "w4_prefill")
        modules = {}
        for kernel in self.w4_kernels(layer):
            try:
                modules[kernel] = build_kernel(kernel, layer, torch.bfloat16).to(self.device)
            except Exception as e:
                self.emit({"name": name, "shape": shape, "rows": rows, "kernel": kernel, "error": str(e)[-300:]})
        w_bf16 = layer.dequantized_weight(torch.bfloat16)
        selected = self.selected(layer)
        if reference == "tinygemm":
            ref_module = modules.get("tinygemm")
            ref_run, ref_bytes = (lambda: ref_module(x)), module_bytes(ref_module)
        else:
            ref_run, ref_bytes = (lambda: x @ w_bf16.T), w_bf16.numel() * 2
        if reference == selected:  # the selected kernel is the reference itself: 1.00x by identity
            ref_us = self.kernel_row(name, shape, rows, f"{reference} (selected)", ref_run, expected, ref_bytes, 0)
        else:
            ref_us = self.kernel_row(name, shape, rows, reference, ref_run, expected, ref_bytes, None)
        for kernel, module in modules.items():
            if kernel == reference:
                continue
            label = f"{kernel} (selected)" if kernel == selected else kernel
            ref = None if ref_us is None else (reference, ref_us)
            self.kernel_row(name, shape, rows, label, lambda m=module: m(x), expected, module_bytes(module), ref)

    def w4_kernels(self, layer) -> list[str]:
        from lmpress.runtime.kernels.select import kernel_candidates

        found = [k for k in kernel_candidates(self.layer_case(layer), self.device_case()) if k != "dense"]
        return found if "tinygemm" in found else ["tinygemm", *found]

    def layer_case(self, layer):
        from lmpress.runtime.kernels.select import LayerCase

        return LayerCase.of(layer)

    def device_case(self):
        """This GPU; a dry run asks as an H100 would (and runs the CUDA kernels' CPU twins)."""
        from lmpress.runtime.kernels.select import DeviceCase

        if self.dry_run:
            return DeviceCase("cuda", self.torch.bfloat16, (9, 0))
        return DeviceCase.here(self.device, self.torch.bfloat16)

    def selected(self, layer) -> str:
        from lmpress.runtime.kernels.select import select_kernel

        case = self.layer_case(layer)
        if self.dry_run:
            return select_kernel(case, self.device_case())
        from lmpress.runtime.kernels import build_kernel
        from lmpress.runtime.kernels.cuda import cuda_kernel_name

        return cuda_kernel_name(layer, case, self.torch.bfloat16, build_kernel)

    def fp8(self, role: str, n: int, k: int, rows: int) -> None:
        torch = self.torch
        from lmpress.runtime.kernels.fp8 import ScaledMMLinear
        from lmpress.weights.float8 import Fp8Linear, quantize_fp8_per_token

        shape = f"{n}x{k} ({role})"
        linear = torch.nn.Linear(k, n, bias=False, device=self.device).requires_grad_(False)
        torch.nn.init.normal_(linear.weight, std=0.02)
        fp8 = Fp8Linear.from_linear(linear, "channel")
        module = ScaledMMLinear(fp8).to(self.device)
        x = torch.randn(rows, k, dtype=torch.bfloat16, device=self.device)
        codes, x_scale = quantize_fp8_per_token(x)
        expected = (codes.double() * x_scale.double()) @ fp8.dequantized_weight(torch.float64).T
        w_bf16 = fp8.dequantized_weight(torch.bfloat16)
        unquantized = x.double() @ fp8.dequantized_weight(torch.float64).T  # bf16 cuBLAS keeps x as it is
        ref_us = self.kernel_row("fp8_prefill", shape, rows, "cublas-bf16", lambda: x @ w_bf16.T, unquantized, 0, None)
        ref = None if ref_us is None else ("cublas-bf16", ref_us)
        self.kernel_row("fp8_prefill", shape, rows, "fp8-scaled-mm (selected)", lambda: module(x), expected, 0, ref)
        weight_t, scale_b = module.weight.t(), module.weight_scale

        def gemm_only():
            return torch._scaled_mm(codes, weight_t, scale_a=x_scale, scale_b=scale_b, out_dtype=torch.bfloat16)

        self.kernel_row("fp8_prefill", shape, rows, "_scaled_mm only", gemm_only, expected, 0, ref)

    def w8(self, role: str, n: int, k: int) -> None:
        torch = self.torch
        from lmpress.runtime.kernels import build_kernel

        layer = quantized_layer(n, k, 8, -1, self.device)
        x = torch.randn(1, k, dtype=torch.bfloat16, device=self.device)
        expected = x.double() @ layer.dequantized_weight(torch.float64).T
        w_bf16 = layer.dequantized_weight(torch.bfloat16)
        shape = f"{n}x{k} ({role})"
        ref_us = self.kernel_row("w8_decode", shape, 1, "cublas-bf16", lambda: x @ w_bf16.T, expected, n * k * 2, None)
        module = build_kernel("triton", layer, torch.bfloat16).to(self.device)
        ref = None if ref_us is None else ("cublas-bf16", ref_us)
        self.kernel_row("w8_decode", shape, 1, "triton", lambda: module(x), expected, module_bytes(module), ref)


def quantized_layer(n: int, k: int, bits: int, group: int, device):
    import torch

    from lmpress.weights.qlinear import QuantizedLinear
    from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

    torch.manual_seed(n * 7 + k)
    w = torch.randn(n, k, device=device) * 0.02
    return QuantizedLinear.from_quantized_weight(quantize_weight_rtn(w, QuantScheme(bits, group, True)))


def sqnr_db(reference, out) -> float:
    import torch

    noise = (reference - out.double()).pow(2).sum().clamp_min(1e-300)
    return float(10 * torch.log10(reference.pow(2).sum() / noise))


def module_bytes(module) -> int:
    """Bytes of a kernel module's buffers (its packed weight, scales, zeros; act-order index and bias)."""
    if module is None:
        return 0
    return sum(b.numel() * b.element_size() for b in module.buffers() if b is not None)


def median_us(run, device, repeats: int = 5) -> float:
    """Median microseconds of ``run()``: ``do_bench`` on CUDA, wall-clock medians on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(run, warmup=10, rep=40, return_mode="median") * 1e3
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def append_json_line(path: Path | None, row: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
