"""Decode of a Llama-3-8B-shaped model (random weights), batch 1: lmpress's runtime against a gpt-fast-style
reference in the same process (``bench/gpt_fast_reference.py``), bf16 and W4 g128, with the profile that explains
the numbers (issue 51). Every row prints the moment it ends.

    python bench/runtime_gpu.py --results results.jsonl      # CUDA: 32 layers, compiled steps in CUDA graphs
    python bench/runtime_gpu.py --dry-run                    # a tiny model on the CPU (dynamo only, no Inductor)

lmpress's rows time the step ``lmpress generate --compile`` and ``lmpress bench --compile`` run
(``generate.compiled_step``: the one-token read and the greedy choice of the next token, compiled whole with
``mode="reduce-overhead"``), fed its own output tokens with no host sync until the last; the reference's rows time
gpt-fast's ``decode_one_token`` compiled the same way over its own cache (sized to the run, as gpt-fast sizes it).
Bytes per token follow ``lmpress.runtime.throughput`` (each weight once, the embedding's one row, the KV cache's
slots held), GB/s = bytes x tok/s, against a device-to-device copy timed in the same run.

Rows, in order: ``copy``; ``decode`` (lmpress bf16 and W4 g128 symmetric RTN at ``--context`` tokens held, each
layer's kernel named, against the reference and W4 against bf16); ``reference``; ``profile`` (``torch.profiler``
over 5 steps of each engine: the 15 kernels with the most device time, launches per token, summed kernel time
against the step's wall time); ``context`` (lmpress's decode with 160, 512 and 2,048 tokens held in one cache,
against the first); ``generate`` (W4: ``lmpress generate --compile``'s own loop, its token read-backs included, the
prefill cancelled, against the bench's step). Goals (issue 51): bf16 >= 75% of the copy bandwidth, W4 >= 2.5x bf16,
lmpress >= 1.0x the reference, 2,048 tokens held >= 0.85x 160, generate >= 0.9x the step. ``--transformers`` adds
transformers' eager generate.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

SHAPES = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
}


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="append one JSON line per row to this file")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU, traced by dynamo only")
    parser.add_argument("--tune", choices=("small", "full", "off"), default="small", help="Triton autotune space")
    parser.add_argument("--layers", type=int, help="decoder layers (default 32; 2 in a dry run)")
    parser.add_argument("--context", type=int, default=512, help="tokens held in the cache for the main rows")
    parser.add_argument("--contexts", type=int, nargs="*", default=[160, 512, 2048], help="the context sweep")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens timed per row")
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler rows")
    parser.add_argument("--transformers", action="store_true", help="also time transformers' eager generate")
    args = parser.parse_args(argv)
    args.shape = "tiny" if args.dry_run else "llama3-8b"
    args.layers = args.layers or (2 if args.dry_run else 32)
    if args.dry_run:
        args.context, args.new_tokens = min(args.context, 48), min(args.new_tokens, 8)
        args.contexts = [min(c, 16 * (i + 1)) for i, c in enumerate(args.contexts)]
    if args.layers < 1 or args.new_tokens < 1 or args.context < 1 or any(c < 1 for c in args.contexts):
        parser.error("--layers, --new-tokens, --context and --contexts must be >= 1")
    args.backend = "eager" if args.dry_run else "inductor"
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    from lmpress.runtime.kernels.tuning import set_tune_space

    set_tune_space(args.tune)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("bench/runtime_gpu.py needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    from lmpress.runtime.throughput import copy_bandwidth_gbs

    began = time.time()
    device = torch.device("cpu" if args.dry_run else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    print(f"{name}  torch {torch.__version__}  {args.shape} x {args.layers} layers, batch 1", flush=True)
    copy_gbs = copy_bandwidth_gbs(device, megabytes=16 if args.dry_run else 1024)
    shape = f"{args.shape} x{args.layers} layers"
    emit(args, {"name": "copy", "shape": "-", "rows": 0, "kernel": "copy_", "gb_s": copy_gbs})
    hf = random_llama(args, device)
    bf16 = engine_rows(args, hf, device, "bf16", copy_gbs, shape, None)
    if args.transformers:
        emit(args, transformers_row(hf, args, copy_gbs, shape))
    quantize_w4(hf)
    gc.collect()
    engine_rows(args, hf, device, "W4 g128", copy_gbs, shape, bf16)
    print(f"({time.time() - began:.0f} s)", flush=True)
    return 0


def emit(args: argparse.Namespace, row: dict) -> None:
    row = {"bench": "runtime_gpu", **row}
    rate = "" if row.get("tok_s") is None else f"{row['tok_s']:8.1f} tok/s"
    gbs = "" if row.get("gb_s") is None else f"{row['gb_s']:6.0f} GB/s"
    pct = "" if row.get("pct_copy") is None else f"{row['pct_copy']:4.0f}% of copy"
    ratio = "" if row.get("ratio") is None else f"{row['ratio']:.2f}x {row['reference']}"
    if row["name"] == "profile":
        rate = f"{row['launches_per_token']:.0f} launches"
        gbs = f"{row['device_busy']:.0%} busy"
    if args.results is not None:  # on disk before it shows: a killed run keeps every row it printed
        args.results.parent.mkdir(parents=True, exist_ok=True)
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
    line = f"{row['name']:<8} {row['shape']:<24} {row['kernel']:<34} {rate:>14} {gbs:>11} {pct:>12}"
    print(f"{line}  {ratio}", flush=True)
    for kernel in row.get("top", [])[:5]:
        print(f"    {kernel['us']:9.1f} us  x{kernel['calls_per_token']:<5g} {kernel['kernel'][:90]}", flush=True)


def random_llama(args: argparse.Namespace, device):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **SHAPES[args.shape],
        num_hidden_layers=args.layers,
        max_position_embeddings=max(4096, args.context),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    return model


def quantize_w4(hf) -> None:
    """Every decoder linear to W4 g128 symmetric RTN, in place, on its device (the head stays bf16)."""
    import torch

    from lmpress.weights.qlinear import QuantizedLinear
    from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

    scheme = QuantScheme(4, 128, True)
    with torch.no_grad():
        for layer in hf.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, child in list(parent.named_children()):
                    if isinstance(child, torch.nn.Linear):
                        qw = quantize_weight_rtn(child.weight.float(), scheme)
                        setattr(parent, name, QuantizedLinear.from_quantized_weight(qw))


def build_runtime(hf, device):
    """The runtime model, built on ``device`` itself (a GPU unpacks and repacks 8B weights in seconds)."""
    import torch

    from lmpress.runtime.model import Transformer

    kernels = "cuda" if device.type == "cuda" else "cpu"
    with torch.device(device):
        return Transformer.from_hf(hf, dtype=torch.bfloat16, device=device, kernels=kernels)


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(run, steps: int, device) -> float:
    """Seconds per call of ``run`` over ``steps`` calls after 3 of warm-up, one sync at each end."""
    for _ in range(3):
        run()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        run()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def lmpress_stepper(model, args, held: int):
    """``run()``: one decode step of lmpress's compiled step from ``held`` tokens on (the cache rewound to ``held``
    when full), each fed the last one's token; the cache holds the sweep's longest context and the tokens timed."""
    import torch

    from lmpress.runtime.generate import compiled_step
    from lmpress.runtime.sample import SamplingConfig

    step = compiled_step("reduce-overhead" if model.device.type == "cuda" else None, backend=args.backend)
    slots = max([args.context, *args.contexts]) + args.new_tokens + 8
    cache = model.new_cache(1, slots)
    greedy = SamplingConfig()
    token = [torch.zeros(1, dtype=torch.long, device=model.device)]

    def at(n: int):
        cache.reset()
        cache.advance(n)

        def run() -> None:
            if cache.length == cache.max_len:
                cache.reset()
                cache.advance(n)
            token[0] = step(model, token[0], cache, greedy, None, None)

        return run

    with torch.no_grad():
        at(held)()  # compiles the step for this cache
    return at


def reference_stepper(reference, args, held: int):
    """``at()``: a ``run()`` doing one step of the reference's compiled ``decode_one_token`` from position ``held``
    on, over a cache of ``held`` + the tokens timed, as gpt-fast sizes its cache to the prompt and the new tokens."""
    import torch
    from gpt_fast_reference import decode_one_token

    device = reference.tok_embeddings.weight.device
    reference.setup_caches(1, held + args.new_tokens + 8)
    mode = "reduce-overhead" if device.type == "cuda" else None
    decode = torch.compile(decode_one_token, mode=mode, fullgraph=True, backend=args.backend)
    token = [torch.zeros(1, 1, dtype=torch.long, device=device)]
    pos = torch.tensor([held], device=device)

    def at():
        pos.fill_(held)

        def run() -> None:
            token[0] = decode(reference, token[0], pos).clone()  # gpt-fast clones each token it keeps
            pos.add_(1)

        return run

    with torch.no_grad():
        at()()  # compiles
    return at


def engine_rows(args, hf, device, label: str, copy_gbs: float, shape: str, bf16: dict | None) -> dict:
    """lmpress's row for ``hf`` as it is (bf16 or W4), the reference's, their profiles, and (W4) the context sweep."""
    import torch
    from gpt_fast_reference import reference_from_hf

    from lmpress.runtime.throughput import kernel_rows, kv_cache_bytes, layer_kernels, weight_bytes

    model = build_runtime(hf, device)
    by_layer = layer_kernels(model)
    counts = {k: list(by_layer.values()).count(k) for k in dict.fromkeys(by_layer.values())}
    kernels = ", ".join(f"{kernel} x{n}" for kernel, n in counts.items())
    per_token = weight_bytes(model) + kv_cache_bytes(model, args.context)
    reference = reference_from_hf(hf, device)
    with torch.no_grad():
        at = lmpress_stepper(model, args, args.context)
        ours = timed_steps(at(args.context), args.new_tokens, device)
        reference_at = reference_stepper(reference, args, args.context)
        theirs = timed_steps(reference_at(), args.new_tokens, device)
    row = rate_row("decode", shape, f"{label} ({kernels})", 1 / ours, per_token, copy_gbs)
    row |= {"graph": device.type == "cuda", "kernels": dict(kernel_rows(by_layer)), "context": args.context}
    row |= {"reference": "gpt-fast-style", "reference_tok_s": 1 / theirs, "ratio": theirs / ours}
    if bf16 is not None:
        row |= {"bf16_tok_s": bf16["tok_s"], "over_bf16": (1 / ours) / bf16["tok_s"]}
    emit(args, row)
    kernel = f"{label} gpt-fast-style decode_one_token"
    emit(args, rate_row("reference", shape, kernel, 1 / theirs, per_token, copy_gbs))
    if not args.no_profile:
        with torch.no_grad():
            emit(args, profile_row(at(args.context), device, "lmpress", label, shape, ours))
            emit(args, profile_row(reference_at(), device, "reference", label, shape, theirs))
    if bf16 is not None:
        emit_context_sweep(args, model, at, device, label, shape)
        emit(args, generate_row(args, model, device, label, shape, 1 / ours))
    del model, reference
    gc.collect()
    return row


def rate_row(name: str, shape: str, kernel: str, tok_s: float, per_token: int, copy_gbs: float) -> dict:
    gbs = tok_s * per_token / 1e9
    row = {"name": name, "shape": shape, "rows": 1, "kernel": kernel, "tok_s": tok_s, "bytes_per_token": per_token}
    return row | {"gb_s": gbs, "pct_copy": 100 * gbs / copy_gbs}


def emit_context_sweep(args, model, at, device, label: str, shape: str) -> None:
    """lmpress's decode with each of ``--contexts`` tokens held in one cache (the attention reads what is held)."""
    import torch

    from lmpress.runtime.throughput import kv_cache_bytes, weight_bytes

    first = None
    for held in args.contexts:
        with torch.no_grad():
            seconds = timed_steps(at(held), args.new_tokens, device)
        first = first or seconds
        per_token = weight_bytes(model) + kv_cache_bytes(model, held)
        row = {"name": "context", "shape": shape, "rows": 1, "kernel": f"{label} at {held} tokens held"}
        row |= {"tok_s": 1 / seconds, "context": held, "bytes_per_token": per_token}
        emit(args, row | {"reference": f"{args.contexts[0]} held", "ratio": first / seconds})


def generate_row(args, model, device, label: str, shape: str, step_tok_s: float) -> dict:
    """``lmpress generate --compile``'s loop on the same model: ``generate`` with the step ``decoding_step`` gives
    it (its own cache sized to the prompt and the new tokens, tokens read back every ``DEVICE_READ_EVERY`` on a
    GPU) after a prompt of ``--context`` tokens; decode tok/s from 1 and ``--new-tokens`` tokens (the prefill
    cancels), against the bench's step at the same context (goal >= 0.9x: no host sync per token)."""
    import torch

    from lmpress.runtime.generate import decoding_step, generate
    from lmpress.runtime.throughput import decode_rate, generation_times

    step = decoding_step(device, compile=True, backend=args.backend)
    prompt = torch.randint(0, model.args.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))

    def run(n: int) -> list[list[int]]:
        with torch.no_grad():
            return generate(model, [prompt.tolist()], max_new_tokens=n, step=step)

    rate = decode_rate(generation_times(run, args.new_tokens, 3, device), args.new_tokens)
    row = {"name": "generate", "shape": shape, "rows": 1, "kernel": f"{label} lmpress generate --compile"}
    return row | {"tok_s": rate, "context": args.context, "reference": "bench step", "ratio": rate / step_tok_s}


PROFILED_STEPS = 5
TOP_KERNELS = 15
CPU_REGIONS = ("Torch-Compiled Region", "TorchDynamo", "## ")  # profiler events around ops, not ops


def profile_row(run, device, engine: str, label: str, shape: str, step_seconds: float) -> dict:
    """``torch.profiler`` over ``PROFILED_STEPS`` calls of ``run``: the ``TOP_KERNELS`` kernels with the most device
    time (CPU ops' self time in a dry run), launches per token, their summed time against the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            run()
        synchronize(device)
    kernels = []
    for event in prof.key_averages():
        if cuda:
            on_device = str(getattr(event, "device_type", "")).endswith("CUDA")
        else:  # ops, without the regions that hold them
            on_device = event.self_cpu_time_total > 0 and not event.key.startswith(CPU_REGIONS)
        us = (event.self_device_time_total if cuda else event.self_cpu_time_total) / PROFILED_STEPS
        if on_device and us > 0:
            kernels.append({"kernel": event.key, "calls_per_token": event.count / PROFILED_STEPS, "us": us})
    kernels.sort(key=lambda k: -k["us"])
    summed = sum(k["us"] for k in kernels)
    launches = sum(k["calls_per_token"] for k in kernels)
    row = {"name": "profile", "shape": shape, "rows": 1, "kernel": f"{engine} {label}", "engine": engine}
    row |= {"launches_per_token": launches, "kernel_us_per_token": summed, "wall_us_per_token": 1e6 * step_seconds}
    return row | {"top": kernels[:TOP_KERNELS], "device_busy": summed / (1e6 * step_seconds)}


def transformers_row(hf, args, copy_gbs: float, shape: str) -> dict:
    import torch

    from lmpress.runtime.throughput import decode_rate, generation_times

    device = hf.device
    ids = torch.zeros(1, 16, dtype=torch.long, device=device)

    def run(n: int):
        with torch.no_grad():
            return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    rate = decode_rate(generation_times(run, args.new_tokens, 1, device), args.new_tokens)
    embed = hf.get_input_embeddings().weight
    per_token = sum(p.numel() * p.element_size() for p in hf.parameters()) - embed.numel() * embed.element_size()
    row = {"name": "hf", "shape": shape, "rows": 1, "kernel": "transformers generate bf16 (eager)", "tok_s": rate}
    return row | {"gb_s": rate * per_token / 1e9, "pct_copy": 100 * rate * per_token / 1e9 / copy_gbs}


if __name__ == "__main__":
    sys.exit(main())
