"""What calling the compiled decode step's graph directly buys over dynamo's entry: one process, two models.

    python bench/decode_entry.py                        # SmolLM2 W4 g64, bfloat16 head (bench/serve.py's artifact)
    python bench/decode_entry.py --head w8 --rounds 10

Through dynamo, each call of the compiled step reads every graph input again from its source (the model's ~420
parameters and buffers through module attributes) and looks the graph up before running it; ``DirectCalls``
(lmpress/runtime/direct_graph.py) calls the graph itself once dynamo has called it for a cache. This bench loads the
artifact twice and times plain decoding's compiled step both ways in one process, alternating (A, B, B, A, ...):
"dynamo" is the same compiled step (``step_compiler``'s, the same Inductor options) called through dynamo at every
token, "direct" is ``decoding_step`` as ``lmpress generate --compile`` and the benches run it. Each round: a new
cache, a 128-token prompt, 8 warm-up tokens, then ``--tokens`` timed; ms per token, and whether both produced the
same tokens. Results: ``bench/results/decode_entry.{json,md}``, one entry per host kind and head.
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
from runtime_hosts import cpu_identity, file_host_entry, quartiles  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WAYS = ("dynamo", "direct")


def steps(device: torch.device) -> dict[str, Any]:
    from lmpress.runtime import generate as gen

    through_dynamo = gen.step_compiler(None, "inductor")(gen._static_sample_step, device)
    return {"dynamo": gen.static_step(through_dynamo), "direct": gen.decoding_step(device, compile=True)}


def timed(model: Any, step: Any, prompt: torch.Tensor, tokens: int) -> tuple[float, list[int]]:
    """ms per token of ``tokens`` steps after a prefill and 8 warm-up steps on a new cache, and the tokens."""
    from lmpress.runtime.generate import prefill
    from lmpress.runtime.sample import SamplingConfig

    greedy = SamplingConfig()
    cache = model.new_cache(1, prompt.shape[1] + tokens + 8)
    token = prefill(model, prompt, cache).argmax(-1)
    for _ in range(8):
        token = step(model, token, cache, greedy, None, None)
    out = []
    began = time.perf_counter()
    for _ in range(tokens):
        token = step(model, token, cache, greedy, None, None)
        out.append(token)
    ms = 1e3 * (time.perf_counter() - began) / tokens
    return ms, torch.cat(out).tolist()


def render(hosts: dict[str, Any]) -> str:
    parts = ["Measured by `python bench/decode_entry.py` (ms per decode token; both ways in one process).\n"]
    for key, entry in hosts.items():
        meta, rows = entry["meta"], entry["rows"]
        parts += [
            f"## {key}\n",
            f"{meta['artifact']}, batch 1, {meta['tokens']} tokens after a 128-token prompt, {meta['threads']} "
            f"threads, {meta['rounds']} alternating rounds, {meta['when']}.\n",
            "| entry | ms per token: median [quartiles] | tok/s at the median |",
            "| --- | --- | --- |",
        ]
        for way in WAYS:
            q1, median, q3 = quartiles(rows[way])
            parts.append(f"| {way} | {median:.3f} [{q1:.3f}, {q3:.3f}] | {1e3 / median:.1f} |")
        parts.append(
            f"\ndirect / dynamo, per round: {entry['ratio']:.3f}x the time (median); same tokens: {entry['same']}\n"
        )
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", default="float", choices=["float", "w8"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import serve

    from lmpress.runtime.text import load_runtime

    torch.set_num_threads(args.threads)
    served = argparse.Namespace(group=64, head=args.head, float_dtype="bfloat16")
    path = serve.artifact(served) / "ct"
    models = {way: load_runtime(str(path), "cpu", "float32")[0] for way in WAYS}
    ways = steps(models["direct"].device)
    prompt = torch.randint(100, models["direct"].args.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    ms: dict[str, list[float]] = {way: [] for way in WAYS}
    tokens: dict[str, list[int]] = {}
    with torch.inference_mode():
        for way in WAYS:  # compiles each
            timed(models[way], ways[way], prompt, 8)
        for round_ in range(args.rounds):
            for way in WAYS if round_ % 2 == 0 else reversed(WAYS):
                took, tokens[way] = timed(models[way], ways[way], prompt, args.tokens)
                ms[way].append(took)
            print(
                f"round {round_ + 1}/{args.rounds}: " + ", ".join(f"{w} {ms[w][-1]:.3f} ms" for w in WAYS), flush=True
            )
    ratio = statistics.median(b / a for a, b in zip(ms["dynamo"], ms["direct"], strict=True))
    meta = {
        "artifact": f"SmolLM2 W4 g64 RTN, head {args.head}, bfloat16 float tensors ({path.parent.name})",
        "tokens": args.tokens,
        "threads": args.threads,
        "rounds": args.rounds,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    entry = {"meta": meta, "rows": ms, "ratio": ratio, "same": tokens["dynamo"] == tokens["direct"]}
    key = f"{cpu_identity()['key']}, head {args.head}"
    print(file_host_entry(args.results / "decode_entry.json", key, entry, render))
    return 0


if __name__ == "__main__":
    sys.exit(main())
