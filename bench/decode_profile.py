"""Where one decode step's time goes on this host: per part of the model (eager) and per op (compiled) (issue 55).

    python bench/decode_profile.py                  # the same-artifact bench's export (bench/serve.py --group 64
                                                    # --head float --float-dtype bfloat16), 2 threads
    python bench/decode_profile.py RUN/compressed-tensors --threads 2 --steps 128
    python bench/decode_profile.py ARTIFACT --prompt-tokens 4000 --kv-cache int8 --results DIR   # a long cache
    python bench/decode_profile.py --read 4         # a verifying read of 4 tokens (speculative decoding, 3 drafts)

One command diagnoses a host kind: results go to ``bench/results/decode_profile.{json,md}``, one entry per host
(CPU model and instruction sets, as ``bench/runtime_hosts.py`` names it); a run replaces only its own host's.

- **Eager, per part**: the uncompiled static step (what ``torch.compile`` compiles) with a timer around each part
  of the model: the head, each kind of linear layer in the blocks (by kernel class: the W4 layers' kernel, ...),
  attention without its linears, the feed-forward's activation without its linears, the norms, the embedding, and
  the rest (the step's time less all of those: Python, the cache's bookkeeping). The timers add a little.
- **Compiled, per op**: the compiled step (as ``bench/serve.py`` and ``lmpress bench --compile`` run it) under
  torch's profiler: the self time of each op it calls (lmpress's kernels are ops of their own; Inductor's fused
  code between them is the self time of the compiled region, "Torch-Compiled Region" / "CompiledFunction"), and
  the step's time without the profiler.

Each figure is ms per decode step at the prompt's length (``--prompt-tokens``, default 128), medians over
``--steps`` steps (eager) or their mean (profiler). Nothing else should run meanwhile. ``--read N`` profiles a
read of N tokens in place of the one-token step (what speculative decoding's target pays to verify N - 1
drafts), its slots written again at every step so each reads the same cache; its entry sits beside the host's
one-token entry. Profile both in one sitting to compare them: a host's speed moves by tens of percent in an hour.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_hosts import cpu_identity, file_host_entry  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FUSED = "Inductor's fused code (the compiled graph's own time)"
SERVE_ARTIFACT = Path(os.path.expanduser("~/.cache/lmpress/bench/serve-w4g64-headfloat-bf16/ct"))


def part_timers(model: torch.nn.Module) -> tuple[dict[str, list[float]], list[Any]]:
    """Forward hooks adding each part's seconds per step into ``totals[part]`` (lists, one entry per step)."""
    from lmpress.runtime.attention import Attention
    from lmpress.runtime.feed_forward import FeedForward, MoEFeedForward
    from lmpress.runtime.linears import FusedLinear, RMSNorm

    started: dict[int, float] = {}
    step: dict[str, float] = defaultdict(float)
    hooks = []

    def timed(module: torch.nn.Module, part: str) -> None:
        def before(mod: torch.nn.Module, args: Any) -> None:
            started[id(mod)] = time.perf_counter()

        def after(mod: torch.nn.Module, args: Any, out: Any) -> None:
            step[part] += time.perf_counter() - started.pop(id(mod))

        hooks.extend((module.register_forward_pre_hook(before), module.register_forward_hook(after)))

    head_weight = getattr(model.output, "weight", None)  # quantized heads hold codes, not a weight
    head_dtype = "" if head_weight is None else f", {head_weight.dtype}"
    timed(model.output, f"head ({type(model.output).__name__}{head_dtype})")
    timed(model.tok_embeddings, "embedding")
    for name, module in model.named_modules():
        if isinstance(module, (Attention, FeedForward, MoEFeedForward)):
            timed(module, "attention" if isinstance(module, Attention) else "feed-forward")
        elif isinstance(module, RMSNorm):
            timed(module, "norms")
        elif isinstance(module, FusedLinear):
            where = "attention" if ".attention." in f".{name}." else "feed-forward"
            for part in module.parts:
                timed(part, f"linears in {where}: {type(part).__name__}")
    return step, hooks


def next_tokens(model: torch.nn.Module, forward: Any, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
    """One step: a decode step (one token: the cache grows by it), or a read of several tokens whose slots the
    next step writes again (the cache keeps its length); the tokens the next step reads."""
    length = cache.length
    chosen = forward(model, tokens, cache).argmax(-1)
    if tokens.shape[1] == 1:
        return chosen
    cache.truncate(length)
    return chosen


def eager_parts(model: torch.nn.Module, prompt: torch.Tensor, steps: int, read: int = 1) -> dict[str, float]:
    """ms per step (a read of ``read`` tokens) of each part (linears taken out of attention and feed-forward),
    medians over ``steps``."""
    from lmpress.runtime.generate import prefill, static_forward

    forward = static_forward()
    step, hooks = part_timers(model)
    per_step: dict[str, list[float]] = defaultdict(list)
    cache = model.new_cache(1, prompt.shape[1] + steps + 8 + read)
    tokens = prefill(model, prompt, cache).argmax(-1)[:, None].repeat(1, read)
    for _ in range(steps):
        step.clear()
        began = time.perf_counter()
        tokens = next_tokens(model, forward, tokens, cache)
        total = time.perf_counter() - began
        for where in ("attention", "feed-forward"):
            inner = sum(v for k, v in step.items() if k.startswith(f"linears in {where}"))
            step[f"{where} without its linears"] = step.pop(where, 0.0) - inner
        step["rest"] = total - sum(step.values())
        step["step"] = total
        for part, seconds in step.items():
            per_step[part].append(seconds)
    for hook in hooks:
        hook.remove()
    return {part: 1e3 * statistics.median(values) for part, values in per_step.items()}


def compiled_ops(model: torch.nn.Module, prompt: torch.Tensor, steps: int, read: int = 1) -> dict[str, float]:
    """ms per step (a read of ``read`` tokens) of each op the compiled step calls (self time), the rest and the
    step without the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from lmpress.runtime.generate import decoding_forward, prefill

    forward = decoding_forward(model.device, compile=True)
    cache = model.new_cache(1, prompt.shape[1] + 3 * steps + 16 + read)
    tokens = prefill(model, prompt, cache).argmax(-1)[:, None].repeat(1, read)
    for _ in range(8):  # compiles, then warms up
        tokens = next_tokens(model, forward, tokens, cache)
    began = time.perf_counter()
    for _ in range(steps):
        tokens = next_tokens(model, forward, tokens, cache)
    step = (time.perf_counter() - began) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            tokens = next_tokens(model, forward, tokens, cache)
    ops = {
        FUSED if e.key.startswith("## Call CompiledFxGraph") else e.key: e.self_cpu_time_total / 1e3 / steps
        for e in prof.key_averages()
        if e.self_cpu_time_total > 0
    }
    profiled = sum(ops.values())
    kept = {k: v for k, v in sorted(ops.items(), key=lambda kv: -kv[1]) if v >= 0.01}
    kept["other ops (< 0.01 ms each)"] = profiled - sum(kept.values())
    return kept | {"step (profiled, all ops)": profiled, "step (not profiled)": 1e3 * step}


def render(hosts: dict[str, Any]) -> str:
    pages = ["Measured by `python bench/decode_profile.py` (ms per decode step, batch 1).\n"]
    for key, entry in hosts.items():
        meta = entry["meta"]
        pages.append(
            f"## {key}\n\n{meta['artifact']}; {meta['threads']} threads, {meta['prompt_tokens']}-token prompt, "
            f"{meta.get('kv_cache', 'float')} KV cache, {meta.get('read', 1)}-token reads, "
            f"{meta['steps']} steps, {meta['when']}, load average {meta['load']}.\n"
        )
        eager = entry["eager"]
        pages.append(f"Eager (uncompiled static step), per part: {eager['step']:.2f} ms a step\n")
        pages.append("| part | ms | share |\n| --- | --- | --- |")
        for part, ms in sorted(eager.items(), key=lambda kv: -kv[1]):
            if part != "step":
                pages.append(f"| {part} | {ms:.2f} | {100 * ms / eager['step']:.0f}% |")
        ops = entry["compiled"]
        step = ops["step (not profiled)"]
        pages.append(
            f"\nCompiled step, per op (self time under the profiler): {step:.2f} ms a step unprofiled "
            f"({1e3 / step:.1f} tok/s)\n"
        )
        pages.append("| op | ms | share of the profiled step |\n| --- | --- | --- |")
        for op, ms in ops.items():
            if not op.startswith("step"):
                pages.append(f"| {op} | {ms:.3f} | {100 * ms / ops['step (profiled, all ops)']:.0f}% |")
        pages.append("")
    return "\n".join(pages) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", type=Path, default=SERVE_ARTIFACT)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--kv-cache", choices=("int8", "int4", "fp8"), help="quantize the cache (default float)")
    parser.add_argument("--read", type=int, default=1, help="tokens a step reads (4: verifying 3 drafts)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not args.artifact.is_dir():
        sys.exit(
            f"{args.artifact}: no export there (the default is bench/serve.py's: run it with --group 64 "
            "--head float --float-dtype bfloat16 first, or name an export)"
        )
    from lmpress.cli import kv_quant_flag
    from lmpress.runtime.text import load_runtime

    torch.set_num_threads(args.threads)
    model, _ = load_runtime(str(args.artifact), "cpu", "float32")
    model.kv_quant = kv_quant_flag(args.kv_cache)
    ids = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, model.args.vocab_size, (1, args.prompt_tokens), generator=ids)
    with torch.inference_mode():
        eager = eager_parts(model, prompt, args.steps, args.read)
        compiled = compiled_ops(model, prompt, args.steps, args.read)
    host = cpu_identity()
    meta = {
        "host": host,
        "artifact": str(args.artifact),
        "threads": args.threads,
        "steps": args.steps,
        "prompt_tokens": args.prompt_tokens,
        "kv_cache": args.kv_cache or "float",
        "read": args.read,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": f"{os.getloadavg()[0]:.2f}",
    }
    entry = {"meta": meta, "eager": eager, "compiled": compiled}
    key = host["key"] if args.read == 1 else f"{host['key']}, {args.read}-token reads"
    print(file_host_entry(args.results / "decode_profile.json", key, entry, render))


if __name__ == "__main__":
    main()
