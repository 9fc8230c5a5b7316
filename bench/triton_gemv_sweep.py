"""Sweep of the one-row W4 GEMV's tiles at Llama-3-8B shapes, untuned launches (CUDA only): which win where.

    python bench/triton_gemv_sweep.py --out bench/results/triton_gemv_sweep.json

For each shape (N x K, W4 g128 symmetric, M=1, bf16) every (BN, NB, SPLIT_K, warps) below is
checked against dequantize-then-matmul once and timed with ``triton.testing.do_bench`` (L2
cleared before each run); also the dequantize kernel alone (the prefill path's first half).
Prints the five fastest tiles per shape and the % of the copy bandwidth they reach.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from bench.triton_kernels import SHAPES, copy_bandwidth_gbs, quantized_layer, sqnr_db

TILES = list(itertools.product((32, 64, 128, 256), (1, 2), (1, 4, 8), (1, 2, 4)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/triton_gemv_sweep.json"))
    args = parser.parse_args()
    import triton.testing

    from lmpress.runtime.kernels import triton as tk

    tk.AUTOTUNE = False
    start = time.time()
    copy_gbs = copy_bandwidth_gbs()
    result = {"device": torch.cuda.get_device_name(), "copy_gbs": round(copy_gbs, 1), "shapes": {}}
    for n, k in SHAPES:
        layer = quantized_layer(n, k, 4, 128)
        packed = tk.prepare_w4a16(layer)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ layer.dequantized_weight(torch.float32).T
        rows = []
        for bn, nb, split, warps in TILES:
            if split * nb > packed.n_blocks:
                continue
            tk.DEFAULT_GEMV = {"BN": bn, "NB": nb, "SPLIT_K": split, "num_warps": warps}
            try:
                db = sqnr_db(ref, tk.w4a16_matmul(x, packed))
                us = triton.testing.do_bench(lambda x=x, p=packed: tk.w4a16_matmul(x, p), warmup=5, rep=25) * 1e3
            except Exception as exc:  # out of resources for a tile: skip it, say so
                print(f"{n}x{k} BN{bn} NB{nb} S{split} w{warps}: {type(exc).__name__}")
                continue
            pct = 100 * packed.nbytes() / us / 1e3 / copy_gbs
            rows.append({"BN": bn, "NB": nb, "SPLIT_K": split, "warps": warps, "us": round(us, 2),
                         "pct_copy": round(pct, 1), "sqnr_db": round(db, 1)})  # fmt: skip
        rows.sort(key=lambda r: r["us"])
        w = torch.empty(n, packed.n_blocks * packed.block, device="cuda", dtype=torch.bfloat16)
        dq_us = triton.testing.do_bench(lambda p=packed, w=w: tk.dequantize(p, torch.bfloat16, w), warmup=5, rep=25)
        dq_us *= 1e3
        moved = packed.nbytes() + w.numel() * 2
        dq_pct = round(100 * moved / dq_us / 1e3 / copy_gbs, 1)
        result["shapes"][f"{n}x{k}"] = {"gemv": rows, "dequantize_us": round(dq_us, 1), "dequantize_pct_copy": dq_pct}
        print(f"\n{n}x{k}: dequantize {dq_us:.1f} us ({dq_pct:.0f}% of copy)")
        for r in rows[:5]:
            print("  ", r)
    print(f"({time.time() - start:.0f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
