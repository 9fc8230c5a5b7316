"""Float32 linear layers on the CPU: ``F.linear`` (``x @ W.T``) against ``DenseLinear`` (``(W @ x.T).T``).

    python bench/dense_matmul.py          # SmolLM2-135M's runtime forward over 1..N tokens, both ways

Times one forward of the whole FP32 runtime model (all 30 layers and the tied 49152-row head,
weights streamed from memory, not cache-resident) after a 128-token prompt, for the token counts
that decoding (1), speculative verification (2-9) and prefill (32-512) read; medians of 7.
Writes bench/results/dense_matmul.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_table import cpu_description  # noqa: E402
from runtime import SMOLLM2, plain_prompt  # noqa: E402

from lmpress.runtime.kernels.cpu import DenseLinear  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TOKENS = (1, 2, 3, 5, 9, 32, 128, 512)


def forward_ms(model, prompt: list[int], n: int, repeats: int) -> float:
    cache = model.new_cache(1, len(prompt) + max(TOKENS))
    times = []
    with torch.no_grad():
        model(torch.tensor([prompt]), cache)
        for _ in range(repeats):
            cache.truncate(len(prompt))
            began = time.perf_counter()
            model(torch.tensor([prompt[:n]]), cache)
            times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from lmpress.runtime.text import load_runtime

    model, tokenizer = load_runtime(SMOLLM2, "cpu", "float32")
    prompt = plain_prompt(tokenizer, 128)
    dense = [m for m in model.modules() if isinstance(m, DenseLinear)]
    timings: dict[str, dict[int, float]] = {}
    for name, weight_left in (("F.linear", False), ("(W @ x.T).T", True)):
        for module in dense:
            module.weight_left = weight_left
        timings[name] = {n: forward_ms(model, prompt, n, args.repeats) for n in TOKENS}
    lines = [
        "| tokens in one forward | " + " | ".join(str(n) for n in TOKENS) + " |",
        "| --- |" + " --- |" * len(TOKENS),
    ]
    for name, row in timings.items():
        lines.append(f"| {name} (ms) | " + " | ".join(f"{row[n]:.1f}" for n in TOKENS) + " |")
    speedup = [timings["F.linear"][n] / timings["(W @ x.T).T"][n] for n in TOKENS]
    lines.append("| speedup | " + " | ".join(f"{s:.2f}x" for s in speedup) + " |")
    from lmpress.runtime.kernels.cpu import weight_left_is_faster

    table = "\n".join(lines) + (
        f"\n\nSmolLM2-135M FP32 runtime forward after a 128-token prompt, {args.threads} threads, {cpu_description()}; "
        f"DenseLinear's probe chose {'(W @ x.T).T' if weight_left_is_faster() else 'F.linear'} on this machine.\n"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dense_matmul.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
