"""Triton W4A16 / W8A16 kernels against tinygemm and cuBLAS at Llama-3-8B shapes (CUDA only).

    python bench/triton_kernels.py --out bench/results/triton_kernels.json

Weights are random, quantized round-to-nearest (W4 g128 symmetric; W8 per-channel
symmetric). Decode: the autotuned one-row GEMV (its chosen tile is reported). Prefill, 2048
rows: the fused GEMM (``path="gemm"``) and the default prefill path (the weight dequantized by a
Triton kernel into a scratch matrix, then cuBLAS). Each kernel is checked against
dequantize-then-matmul in float32 at the shape before it is timed. Times are medians of
``triton.testing.do_bench`` (which clears the L2 cache before every run, so weights come from HBM). Bandwidth counts the
bytes a kernel must read for its weight (codes + scales + zeros), compared with a
device-to-device copy measured in the same run (bytes read + written).

tinygemm (``torch.ops.aten._weight_int4pack_mm``, torch >= 2.5 on CUDA) takes the
codes as uint8 ``(N, K/2)`` with the even column in the high nibble, packed by
``_convert_weight_to_int4pack(.., innerKTiles=8)``, and a bf16 ``(K/g, N, 2)``
scale-and-zero tensor meaning ``w = (q - 8) * scale + zero`` (torch's test_linalg.py);
lmpress's ``(q - z) * s`` is then ``zero = (8 - z) * s``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

# N x K (out x in): attention out, gate/up, down, fused qkv.
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]
PREFILL_ROWS = 2048
GROUP = 128
MIN_SQNR_DB = 40.0


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference - other.float()).pow(2).sum().clamp_min(1e-30)
    return float(10 * torch.log10(reference.pow(2).sum() / noise))


def copy_bandwidth_gbs() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / bench_ms(lambda: dst.copy_(src)) / 1e6


def quantized_layer(n: int, k: int, bits: int, group: int):
    from lmpress.quantize.qlinear import QuantizedLinear
    from lmpress.quantize.scheme import QuantScheme, quantize_weight_rtn

    w = torch.randn(n, k, device="cuda") * 0.02
    return QuantizedLinear.from_quantized_weight(quantize_weight_rtn(w, QuantScheme(bits, group, True)))


def tinygemm(layer) -> tuple[torch.Tensor, torch.Tensor]:
    codes = layer.codes().to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), 8)
    scales = layer.scales.float()
    offsets = (8.0 - layer.zeros.float()) * scales
    scale_and_zero = torch.stack([scales.t(), offsets.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scale_and_zero


def checked(name: str, reference: torch.Tensor, out: torch.Tensor, rows: dict) -> None:
    db = sqnr_db(reference, out)
    rows[f"{name}_sqnr_db"] = round(db, 1)
    if db < MIN_SQNR_DB:
        raise SystemExit(f"{name}: SQNR {db:.1f} dB < {MIN_SQNR_DB} dB against the dequantized reference")


def w4_rows(n: int, k: int, copy_gbs: float) -> dict:
    from lmpress.runtime.kernels.triton import prepare_w4a16, w4a16_matmul

    layer = quantized_layer(n, k, 4, GROUP)
    packed = prepare_w4a16(layer)
    weight = layer.dequantized_weight(torch.float32)
    row = {"shape": f"{n}x{k}"}
    x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref1 = x1.float() @ weight.T
    checked("triton_gemv", ref1, w4a16_matmul(x1, packed), row)
    t_triton = bench_ms(lambda: w4a16_matmul(x1, packed)) * 1e3
    row.update(triton_gemv_us=round(t_triton, 2), weight_mb=round(packed.nbytes() / 1e6, 2))
    gbs = packed.nbytes() / t_triton / 1e3
    row.update(triton_gemv_gbs=round(gbs, 1), triton_gemv_pct_copy=round(100 * gbs / copy_gbs, 1))
    tg_weight, tg_sz = tinygemm(layer)
    tg = lambda: torch.ops.aten._weight_int4pack_mm(x1, tg_weight, GROUP, tg_sz)
    checked("tinygemm", ref1, tg(), row)
    t_tg = bench_ms(tg) * 1e3
    tg_bytes = tg_weight.numel() * tg_weight.element_size() + tg_sz.numel() * 2
    row.update(tinygemm_us=round(t_tg, 2), tinygemm_pct_copy=round(100 * tg_bytes / t_tg / 1e3 / copy_gbs, 1))
    row["gemv_speedup_vs_tinygemm"] = round(t_tg / t_triton, 3)
    row["gemv_config"] = tuned_config("gemv_row")  # one row: the row kernel
    xp = torch.randn(PREFILL_ROWS, k, device="cuda", dtype=torch.bfloat16)
    reference = xp.float() @ weight.T
    checked("triton_gemm", reference, w4a16_matmul(xp, packed, "gemm"), row)
    checked("prefill", reference, w4a16_matmul(xp, packed), row)
    dense = weight.to(torch.bfloat16)
    t_gemm = bench_ms(lambda: w4a16_matmul(xp, packed, "gemm")) * 1e3
    t_prefill = bench_ms(lambda: w4a16_matmul(xp, packed)) * 1e3
    t_cublas = bench_ms(lambda: xp @ dense.T) * 1e3
    row.update(triton_gemm_us=round(t_gemm, 1), prefill_us=round(t_prefill, 1), cublas_gemm_us=round(t_cublas, 1))
    row["gemm_ratio_vs_cublas"] = round(t_cublas / t_gemm, 3)
    row["prefill_ratio_vs_cublas"] = round(t_cublas / t_prefill, 3)
    row["gemm_config"] = tuned_config("gemm")
    return row


def tuned_config(kind: str) -> str:
    """The config the autotuner chose for the last shape it tuned (kwargs, warps, stages)."""
    from lmpress.runtime.kernels import triton as tk

    tuner = tk._tuned(kind)
    config = list(tuner.cache.values())[-1] if tuner.cache else None
    return "untuned" if config is None else f"{config.kwargs} w{config.num_warps} s{config.num_stages}"


def w8_rows(n: int, k: int, copy_gbs: float) -> dict:
    from lmpress.runtime.kernels.triton import prepare_w8a16, w8a16_matmul

    layer = quantized_layer(n, k, 8, -1)
    packed = prepare_w8a16(layer)
    weight = layer.dequantized_weight(torch.float32)
    x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    row = {"shape": f"{n}x{k}"}
    checked("w8_gemv", x1.float() @ weight.T, w8a16_matmul(x1, packed), row)
    t8 = bench_ms(lambda: w8a16_matmul(x1, packed)) * 1e3
    dense = weight.to(torch.bfloat16)
    t_dense = bench_ms(lambda: x1 @ dense.T) * 1e3
    row.update(w8_gemv_us=round(t8, 2), w8_pct_copy=round(100 * packed.nbytes() / t8 / 1e3 / copy_gbs, 1))
    row.update(
        cublas_bf16_gemv_us=round(t_dense, 2),
        cublas_pct_copy=round(100 * dense.numel() * 2 / t_dense / 1e3 / copy_gbs, 1),
    )
    row["w8_speedup_vs_cublas_bf16"] = round(t_dense / t8, 3)
    return row


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    print(f"\n{title}")
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(columns, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/triton_kernels.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/triton_kernels.py needs a CUDA GPU")
    import triton

    start = time.time()
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    w4 = [w4_rows(n, k, copy_gbs) for n, k in SHAPES]
    w8 = [w8_rows(n, k, copy_gbs) for n, k in SHAPES]
    summary = {
        "gemv_geomean_speedup_vs_tinygemm": round(geomean([r["gemv_speedup_vs_tinygemm"] for r in w4]), 3),
        "gemm_geomean_ratio_vs_cublas": round(geomean([r["gemm_ratio_vs_cublas"] for r in w4]), 3),
        "prefill_geomean_ratio_vs_cublas": round(geomean([r["prefill_ratio_vs_cublas"] for r in w4]), 3),
        "w8_geomean_speedup_vs_cublas_bf16": round(geomean([r["w8_speedup_vs_cublas_bf16"] for r in w8]), 3),
        "gemv_pct_copy_at_4096x14336": next(r["triton_gemv_pct_copy"] for r in w4 if r["shape"] == "4096x14336"),
    }
    print_table(
        "W4A16 g128 sym decode, M=1 bf16 (us; % of copy bandwidth)",
        w4,
        ["shape", "weight_mb", "triton_gemv_us", "triton_gemv_gbs", "triton_gemv_pct_copy", "tinygemm_us",
         "tinygemm_pct_copy", "gemv_speedup_vs_tinygemm", "triton_gemv_sqnr_db", "tinygemm_sqnr_db", "gemv_config"],
    )  # fmt: skip
    print_table(
        f"W4A16 prefill, M={PREFILL_ROWS} (us)",
        w4,
        [
            "shape",
            "triton_gemm_us",
            "gemm_ratio_vs_cublas",
            "prefill_us",
            "prefill_ratio_vs_cublas",
            "cublas_gemm_us",
            "triton_gemm_sqnr_db",
            "prefill_sqnr_db",
        ],
    )
    print_table(
        "W8A16 per-channel decode, M=1 vs bf16 cuBLAS GEMV (us)",
        w8,
        ["shape", "w8_gemv_us", "w8_pct_copy", "cublas_bf16_gemv_us", "cublas_pct_copy", "w8_speedup_vs_cublas_bf16"],
    )
    print("\nsummary (goals: gemv >= 1.2x tinygemm geomean, >= 70% copy at 4096x14336; gemm >= 0.8x cuBLAS)")
    for key, value in summary.items():
        print(f"  {key}: {value}")
    print(f"({time.time() - start:.0f} s)")
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gbs": round(copy_gbs, 1),
        "w4": w4,
        "w8": w8,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
