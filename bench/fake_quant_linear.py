"""One fake-quantized integer linear's forward and backward in distillation: ``IntGroupsLinear`` (the codes kept in a
byte, the product rebuilt in the backward pass) against autograd over the same expression (``quantized_weight()``),
with and without act-order's column groups; SmolLM2's MLP shapes, W3 g64, codes fixed (scales train), 512 tokens.

    python bench/fake_quant_linear.py

Each timing is the best of three rounds of ten calls (after one warm call), the two implementations alternating.
Results:
``bench/results/fake_quant_linear.md``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lmpress, before an installed one
from runtime_hosts import cpu_identity  # noqa: E402

from lmpress.distill.student import FakeQuantLinear  # noqa: E402
from lmpress.weights.qlinear import quantized_linear_from  # noqa: E402
from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "fake_quant_linear.md"
SHAPES = [(1536, 576), (576, 1536)]  # gate/up, down
TOKENS = 512


def best_ms(step, rounds: int = 3, calls: int = 10) -> float:
    times = []
    for _ in range(rounds):
        step()
        began = time.perf_counter()
        for _ in range(calls):
            step()
        times.append((time.perf_counter() - began) / calls * 1e3)
    return min(times)


def row(out_features: int, in_features: int, act_order: bool) -> tuple[float, float]:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False)
    layer = quantized_linear_from(linear, quantize_weight_rtn(linear.weight.data, QuantScheme(3, 64, True)))
    if act_order:
        layer.g_idx = torch.randperm(in_features).int() // 64
    fake = FakeQuantLinear(layer, learn_weights=False)
    x = torch.randn(TOKENS, in_features, requires_grad=True)
    ours, reference = [], []
    for _ in range(3):
        ours.append(best_ms(lambda: fake(x).sum().backward(), rounds=1))
        reference.append(best_ms(lambda: nn.functional.linear(x, fake.quantized_weight()).sum().backward(), rounds=1))
    return min(ours), min(reference)


def main() -> None:
    lines = [
        "| shape (out x in) | act-order | IntGroupsLinear ms | autograd ms | ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for act_order in (False, True):
        for out_features, in_features in SHAPES:
            ours, reference = row(out_features, in_features, act_order)
            lines.append(
                f"| {out_features} x {in_features} | {'yes' if act_order else 'no'} | {ours:.2f} | {reference:.2f} "
                f"| {ours / reference:.2f} |"
            )
            print(lines[-1], flush=True)
    host = cpu_identity()["key"]
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    RESULTS.write_text(
        f"# {Path(__file__).name}, {stamp}\n\n" + "\n".join(lines) + f"\n\n{host}, {torch.get_num_threads()} threads, "
        f"{TOKENS} tokens, W3 g64 codes fixed; forward and backward of one layer, best of 3 x 10 calls.\n"
    )


if __name__ == "__main__":
    main()
