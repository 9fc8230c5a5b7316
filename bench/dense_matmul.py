"""Float32 linear layers on the CPU: ``F.linear`` (``x @ W.T``) against ``DenseLinear`` (``(W @ x.T).T``).

    python bench/dense_matmul.py          # SmolLM2-135M's runtime forward over 1..N tokens, both ways

Times one forward of the whole FP32 runtime model (all 30 layers and the tied 49152-row head,
weights streamed from memory, not cache-resident) after a 128-token prompt, for the token counts
that decoding (1), speculative verification (2-9) and prefill (32-128) read; medians of 7.
Also times ``W @ x.T`` on one weight shape with ``x`` row-major against ``x.T`` contiguous (why
``DenseLinear`` hands BLAS row-major rows). Writes bench/results/dense_matmul.md.
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
TOKENS = (1, 2, 3, 5, 9, 32, 128)  # at most the prompt's 128: a forward reads the prompt's first n tokens


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


def layout_us(
    rows: int, row_major: bool, shape: tuple[int, int] = (3072, 576), repeats: int = 7, pad_to: int = 0
) -> float:
    """Median us of ``W @ x.T`` for ``rows`` rows, ``x`` row-major (``x.T`` a transposed view) or column-major
    (``x.T`` contiguous, as a previous ``(W @ x.T).T`` output hands it on), over 256 MB of weights; with
    ``pad_to``, ``x``'s first row repeated to that many rows (as ``DenseLinear`` pads 3 rows to 4)."""
    weights = [torch.randn(shape) for _ in range(max(1, 256 * 2**20 // (shape[0] * shape[1] * 4)))]
    x = torch.randn(rows, shape[1])
    x = torch.cat([x] + [x[:1]] * (pad_to - rows)) if pad_to > rows else x
    right = x.t() if row_major else x.t().contiguous()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        for weight in weights:
            weight @ right
        times.append((time.perf_counter() - began) / len(weights))
    return statistics.median(times) * 1e6


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
    probed = [(m.left_for_one, m.left_for_few) for m in dense]
    choices = sorted({(m.out_features, m.in_features, c) for m, c in zip(dense, probed, strict=True)})
    timings: dict[str, dict[int, float]] = {}
    for name, choice in (("F.linear", (False, False)), ("(W @ x.T).T", (True, True)), ("DenseLinear as probed", None)):
        for module, own in zip(dense, probed, strict=True):
            module.left_for_one, module.left_for_few = own if choice is None else choice
        timings[name] = {n: forward_ms(model, prompt, n, args.repeats) for n in TOKENS}
    lines = [
        "| ms per forward, tokens: | " + " | ".join(str(n) for n in TOKENS) + " |",
        "| --- |" + " --- |" * len(TOKENS),
    ]
    for name, row in timings.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[n]:.1f}" for n in TOKENS) + " |")
    speedup = [timings["F.linear"][n] / timings["DenseLinear as probed"][n] for n in TOKENS]
    lines.append("| F.linear / as probed | " + " | ".join(f"{s:.2f}x" for s in speedup) + " |")
    probe = "; ".join(
        f"{o} x {i}: one row {'left' if a else 'F.linear'}, few {'left' if b else 'F.linear'}"
        for o, i, (a, b) in choices
    )
    table = "\n".join(lines) + (
        f"\n\nSmolLM2-135M FP32 runtime forward after a 128-token prompt, {args.threads} threads, "
        f"{cpu_description()}; (W @ x.T).T applies to <= {DenseLinear.FEW_ROWS} rows. The probe chose: {probe}.\n"
    )
    layout_rows = (2, 4, 8)
    table += "\n| W @ x.T, 3072 x 576, us per product, rows: | " + " | ".join(map(str, layout_rows)) + " |\n"
    table += "| --- |" + " --- |" * len(layout_rows) + "\n"
    for label, row_major in (("x row-major (x.T a view)", True), ("x.T contiguous", False)):
        table += f"| {label} | " + " | ".join(f"{layout_us(r, row_major):.0f}" for r in layout_rows) + " |\n"
    shapes = sorted({(o, i) for o, i, _ in choices})
    table += "\n| W @ x.T over 3 rows, us per product: | " + " | ".join(f"{o} x {i}" for o, i in shapes) + " |\n"
    table += "| --- |" + " --- |" * len(shapes) + "\n"
    for label, pad_to in (("3 rows", 0), ("3 rows padded to 4 (DenseLinear)", 4)):
        cells = " | ".join(f"{layout_us(3, True, shape, pad_to=pad_to):.0f}" for shape in shapes)
        table += f"| {label} | {cells} |\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dense_matmul.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
