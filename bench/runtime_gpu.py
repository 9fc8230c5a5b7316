"""CUDA decode of a Llama-3-8B-shaped model (random weights) on lmpress's runtime (issue 11, GPU table).

    python bench/runtime_gpu.py                          # on a CUDA machine: table on stdout + --out JSON
    python bench/runtime_gpu.py --shape tiny --device cpu --new-tokens 8    # the script itself, anywhere

Rows, batch 1, a 128-token prompt, greedy, one process: transformers ``generate`` (eager, bf16);
lmpress bf16 and W4 g128 (RTN; speed does not depend on the method), each eager and with the
decode step compiled and captured in a CUDA graph (``torch.compile(mode="reduce-overhead")``).
Random weights at real shapes are fine for speed. Decode tok/s, bytes per token and % of the
copy bandwidth follow ``lmpress.runtime.bench`` (the same definitions as ``lmpress bench``).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

import torch

SHAPES = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
}


def random_llama(shape: str, device: torch.device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    return model


def hf_row(model, prompt: list[int], args: argparse.Namespace) -> dict[str, Any]:
    from lmpress.runtime.bench import copy_bandwidth_gbs, decode_rate, generation_times

    device = model.device
    ids = torch.tensor([prompt], device=device)

    def run(n: int) -> Any:
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    times = generation_times(run, args.new_tokens, args.repeats, device)
    rate = decode_rate(times, args.new_tokens)
    embed = model.get_input_embeddings().weight  # untied: one row of it is read per token, the head whole
    per_token = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    bandwidth = copy_bandwidth_gbs(device)
    return {
        "decode_tok_s": rate,
        "ttft_s": times[0],
        "bytes_per_token": per_token,
        "decode_gb_s": rate * per_token / 1e9,
        "bandwidth_gb_s": bandwidth,
        "bandwidth_pct": 100 * rate * per_token / 1e9 / bandwidth,
    }


def runtime_rows(hf, prompt: list[int], args: argparse.Namespace, label: str) -> dict[str, dict[str, Any]]:
    from lmpress.runtime.bench import BenchSettings, benchmark
    from lmpress.runtime.model import Transformer

    model = Transformer.from_hf(hf, dtype=torch.bfloat16, device=args.device)
    rows = {}
    for compiled in (False, True):
        settings = BenchSettings(new_tokens=args.new_tokens, repeats=args.repeats, compile=compiled)
        name = f"lmpress {label}"
        if compiled:
            name += " + CUDA graph" if model.device.type == "cuda" else " + torch.compile"
        rows[name] = benchmark(model, prompt, settings)["plain"]
        print(f"{name}: {rows[name]['decode_tok_s']:.1f} tok/s", flush=True)
    del model
    gc.collect()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    import lmpress

    device = torch.device(args.device)
    hf = random_llama(args.shape, device)
    prompt = torch.randint(0, hf.config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    rows = {"transformers generate bf16 (eager)": hf_row(hf, prompt, args)}
    print(f"transformers: {rows['transformers generate bf16 (eager)']['decode_tok_s']:.1f} tok/s", flush=True)
    rows |= runtime_rows(hf, prompt, args, "bf16")
    lmpress.quantize_model(hf, method="rtn", bits=4, group_size=128, symmetric=True)
    gc.collect()
    rows |= runtime_rows(hf, prompt, args, "W4 g128")
    print("\n| row | decode tok/s | GB read/token | GB/s | % of copy bandwidth |\n|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['decode_tok_s']:.1f} | {r['bytes_per_token'] / 1e9:.2f} | {r['decode_gb_s']:.0f} | "
            f"{r['bandwidth_pct']:.0f}% of {r['bandwidth_gb_s']:.0f} |"
        )
    if args.out:
        meta = {"shape": args.shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
