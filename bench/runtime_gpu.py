"""Decode of a Llama-3-8B-shaped model (random weights), batch 1, on lmpress's runtime: W4 against bf16, bf16
against the copy bandwidth (issue 37's decode goals). Every row prints the moment it ends.

    python bench/runtime_gpu.py --results results.jsonl      # CUDA: 32 layers, CUDA graphs
    python bench/runtime_gpu.py --dry-run                    # a tiny model on the CPU (eager)

Each row times the runtime's fixed-shape decode step (``Transformer.forward_static``, what
``lmpress generate --compile`` compiles) captured once in a CUDA graph and replayed per token: no
compile time, no launch overhead; decode tok/s = tokens / seconds of the replays. Bytes per token
follow ``lmpress.runtime.throughput`` (every weight once, the embedding's one row, the KV cache's slots the
static step reads), GB/s = bytes x tok/s, against a device-to-device copy timed in the same run.
Rows: bf16 (goal: >= 70% of the copy bandwidth) and W4 g128 symmetric RTN on the kernels
``lmpress.runtime.kernels.select`` picks, each layer's kernel named (goal: >= 2.0x bf16; issue 37 measured
bf16 140 tok/s before). ``--compile`` adds the runtime's own ``torch.compile`` path
(``lmpress.runtime.throughput``, CUDA graphs through Inductor), ``--transformers`` transformers' eager generate.
``--layers`` shortens the model (the unquantized 1 GB head then weighs more in the W4/bf16 ratio).
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
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU, eager")
    parser.add_argument("--tune", choices=("small", "full", "off"), default="small", help="Triton autotune space")
    parser.add_argument("--layers", type=int, help="decoder layers (default 32; 2 in a dry run)")
    parser.add_argument("--context", type=int, default=512, help="KV cache slots the static step reads")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens timed per row")
    parser.add_argument("--compile", action="store_true", help="also time lmpress's torch.compile decode path")
    parser.add_argument("--transformers", action="store_true", help="also time transformers' eager generate")
    args = parser.parse_args(argv)
    args.shape = "tiny" if args.dry_run else "llama3-8b"
    args.layers = args.layers or (2 if args.dry_run else 32)
    if args.dry_run:
        args.context, args.new_tokens = min(args.context, 64), min(args.new_tokens, 8)
    if args.layers < 1 or args.new_tokens < 1 or args.context <= args.new_tokens:
        parser.error("--layers and --new-tokens must be >= 1 and --context larger than --new-tokens")
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
    bf16 = decode_row(args, hf, device, "bf16", copy_gbs, shape, None)
    if args.transformers:
        emit(args, transformers_row(hf, args, copy_gbs, shape))
    quantize_w4(hf)
    gc.collect()
    decode_row(args, hf, device, "W4 g128", copy_gbs, shape, bf16)
    print(f"({time.time() - began:.0f} s)", flush=True)
    return 0


def emit(args: argparse.Namespace, row: dict) -> None:
    row = {"bench": "runtime_gpu", **row}
    rate = "" if row.get("tok_s") is None else f"{row['tok_s']:8.1f} tok/s"
    gbs = "" if row.get("gb_s") is None else f"{row['gb_s']:6.0f} GB/s"
    pct = "" if row.get("pct_copy") is None else f"{row['pct_copy']:4.0f}% of copy"
    ratio = "" if row.get("ratio") is None else f"{row['ratio']:.2f}x {row['reference']}"
    if args.results is not None:  # on disk before it shows: a killed run keeps every row it printed
        args.results.parent.mkdir(parents=True, exist_ok=True)
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
    line = f"{row['name']:<8} {row['shape']:<24} {row['kernel']:<34} {rate:>14} {gbs:>11} {pct:>12}"
    print(f"{line}  {ratio}", flush=True)


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


def static_step_rate(model, args: argparse.Namespace, device) -> float:
    """Decode tok/s of the fixed-shape step, replayed from one CUDA graph (on the CPU: run eagerly)."""
    import torch

    cache = model.new_cache(1, args.context)
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    pos = torch.zeros(1, dtype=torch.long, device=device)

    def step():
        return model.forward_static(token, cache.k, cache.v, cache.pad, pos)

    with torch.no_grad():
        if device.type == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # tunes and compiles every kernel before the capture
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run = graph.replay
        else:
            step()
            run = step
        for i in range(4):
            pos.fill_(i)
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for i in range(args.new_tokens):
            pos.fill_(i)
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return args.new_tokens / (time.perf_counter() - start)


def decode_row(args, hf, device, label: str, copy_gbs: float, shape: str, bf16: dict | None) -> dict:
    from lmpress.runtime.throughput import kernel_rows, kv_cache_bytes, layer_kernels, weight_bytes

    model = build_runtime(hf, device)
    by_layer = layer_kernels(model)
    counts = {k: list(by_layer.values()).count(k) for k in dict.fromkeys(by_layer.values())}
    kernels = ", ".join(f"{kernel} x{n}" for kernel, n in counts.items())
    rate = static_step_rate(model, args, device)
    per_token = weight_bytes(model) + kv_cache_bytes(model, args.context)
    row = {"name": "decode", "shape": shape, "rows": 1, "kernel": f"{label} ({kernels})", "tok_s": rate}
    row |= {
        "bytes_per_token": per_token,
        "gb_s": rate * per_token / 1e9,
        "pct_copy": 100 * rate * per_token / 1e9 / copy_gbs,
    }
    row |= {"graph": device.type == "cuda", "kernels": dict(kernel_rows(by_layer))}
    if bf16 is not None:
        row |= {"reference": "bf16", "reference_tok_s": bf16["tok_s"], "ratio": rate / bf16["tok_s"]}
    emit(args, row)
    if args.compile:
        emit(args, compiled_row(model, args, label, copy_gbs, shape))
    del model
    gc.collect()
    return row


def compiled_row(model, args, label: str, copy_gbs: float, shape: str) -> dict:
    """The runtime's own ``torch.compile`` path (``lmpress bench --compile``), for comparison."""
    from lmpress.runtime.throughput import BenchSettings, benchmark

    prompt = list(range(1, 17))
    plain = benchmark(model, prompt, BenchSettings(new_tokens=args.new_tokens, repeats=1, compile=True))["plain"]
    row = {"name": "compiled", "shape": shape, "rows": 1, "kernel": f"{label} (lmpress bench --compile)"}
    return row | {"tok_s": plain["decode_tok_s"], "gb_s": plain["decode_gb_s"], "pct_copy": plain["bandwidth_pct"]}


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
