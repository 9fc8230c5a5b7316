"""A decode step's attention at Llama-3-8B's shape on a GPU: lmpress's Triton split-K kernel over bfloat16 entries,
int8, FP8 and INT4 codes, against the pointwise attention the CUDA static step ran before it (issues 50, 51).
Every row prints the moment it ends.

    python bench/decode_attention.py --results results.jsonl   # CUDA (bench/gpu_check.sh): one JSON line per row
    python bench/decode_attention.py --dry-run                 # tiny, on the CPU, Triton interpreted

Rows: 32 query heads on 8 KV heads of 128, one new token, a cache of ``--slots`` (8,192) slots filled to 512,
2,048 and 8,192. ``us``: ``triton.testing.do_bench`` median (L2 cleared before each run). ``GB/s``: the filled
slots' bytes (codes and scales, keys and values) over the time: what the kernel must read. Each way is checked
against a float64 softmax over the dequantized cache first (``sqnr_db``; ``ok`` at >= 40 dB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from functools import partial
from pathlib import Path

HEADS, KV_HEADS, DIM, SLOTS = 32, 8, 128, 8192
FILLS = (512, 2048, 8192)
DRY = dict(heads=4, kv_heads=2, dim=32, slots=600, fills=(300,))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="append one JSON line per row to this file")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, Triton interpreted")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("bench/decode_attention.py needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    from lmpress.runtime.attention import pointwise_attention
    from lmpress.runtime.kernels.triton_attention import decode_attention
    from lmpress.runtime.kv_cache import static_slots_mask
    from lmpress.weights.kv_quant import KVScheme, dequantize_kv, fp8_scale_from_amax, quantize_kv

    shape = DRY if args.dry_run else dict(heads=HEADS, kv_heads=KV_HEADS, dim=DIM, slots=SLOTS, fills=FILLS)
    device = torch.device("cpu" if args.dry_run else "cuda")
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, slots = shape["heads"], shape["kv_heads"], shape["dim"], shape["slots"]
    keys, values = (torch.randn(1, kv_heads, slots, dim, generator=g) for _ in range(2))
    q = (torch.randn(1, heads, 1, dim, generator=g) * 3).to(device, torch.bfloat16)
    caches = {"bf16": (keys.bfloat16(), None, values.bfloat16(), None, keys.bfloat16(), values.bfloat16())}
    schemes = {"int8": KVScheme("int8", "token"), "fp8 per head": KVScheme("fp8", "head")}
    schemes["int4 per token"] = KVScheme("int4", "token")
    for name, scheme in schemes.items():
        coded = []
        for x in (keys, values):
            scale = fp8_scale_from_amax(x.abs().amax(dim=(0, 2, 3))) if scheme.dtype == "fp8" else None
            codes, scales = quantize_kv(x, scheme, scale)
            coded.append((codes, scales, dequantize_kv(codes, scales, scheme, torch.bfloat16)))
        (k, ks, kd), (v, vs, vd) = coded
        caches[name] = (k, ks, v, vs, kd, vd)
    timing = _timer(device)
    for fill in shape["fills"]:
        pos = torch.tensor([fill - 1], device=device)
        mask = static_slots_mask(torch.tensor([0], device=device), pos, slots, None)
        for name, (k, ks, v, vs, kd, vd) in caches.items():
            on = [None if t is None else t.to(device) for t in (k, ks, v, vs, kd, vd)]
            k, ks, v, vs, kd, vd = on
            want = _reference(q, kd, vd, mask)
            ways = {
                "triton": partial(decode_attention, q, k, ks, v, vs, mask, pos, dim**-0.5),
                "pointwise": partial(pointwise_attention, q, kd, vd, mask, dim**-0.5),
            }
            for way, run in ways.items():
                if way == "pointwise" and name != "bf16":
                    continue  # it reads the dequantized cache: the same bytes as bf16's
                sqnr = _sqnr_db(run(), want)
                us = timing(run)
                filled = (
                    fill
                    * kv_heads
                    * 2
                    * (k.shape[-1] * k.element_size() + (4 if ks is not None and ks.dim() == 4 else 0))
                )
                row = {"bench": "decode_attention", "cache": name, "way": way, "fill": fill, "slots": slots}
                row |= {"us": us, "gb_s": filled / us / 1e3, "sqnr_db": sqnr, "ok": sqnr >= 40.0}
                print(f"{name} fill {fill} {way}: {us:.1f} us, {row['gb_s']:.0f} GB/s, {sqnr:.1f} dB", flush=True)
                if args.results:
                    with args.results.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    return 0


def _reference(q, keys, values, mask):  # noqa: ANN001, ANN202 - float64 softmax, GQA by repetition
    group = q.shape[1] // keys.shape[1]
    k, v = (x.double().repeat_interleave(group, 1) for x in (keys, values))
    scores = (q.double() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def _sqnr_db(got, want) -> float:  # noqa: ANN001
    noise = (got.double() - want).pow(2).sum().item()
    return float("inf") if noise == 0 else 10 * math.log10(want.pow(2).sum().item() / noise)


def _timer(device):  # noqa: ANN001, ANN202
    import time

    if device.type == "cuda":
        import triton.testing

        return lambda run: 1e3 * triton.testing.do_bench(run)

    def cpu(run) -> float:  # noqa: ANN001 - the dry run: one call, to check the script
        began = time.perf_counter()
        run()
        return 1e6 * (time.perf_counter() - began)

    return cpu


if __name__ == "__main__":
    sys.exit(main())
