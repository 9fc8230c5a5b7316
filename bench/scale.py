"""What GPTQ W4 costs at 1B and 8B scale on this machine: peak RSS, seconds per layer, the whole model projected.

    python bench/scale.py                                   # both shapes: 2 layers, then 4 (the projection check)
    python bench/scale.py --shapes llama-3-8b --layers 4 --check-layers 8
    python bench/scale.py --device cuda --shapes llama-3-8b --layers 4 --check-layers 0   # a GPU visit
    python bench/scale.py --shapes qwen3-30b-a3b --layers 2 --out bench/results/scale_moe.json

Builds, once, random-weight checkpoints with the exact shapes of Llama-3.2-1B, Llama-3-8B and Qwen3-30B-A3B
(bfloat16 safetensors, sharded as the hub shards them: one file for 1B, four of at most 5 GB with an index for 8B;
cached under lmpress's cache directory; the 8B one is 16 GB on disk; the MoE one holds only its first 4 of 48
layers, each expert a tensor of its own as the hub stores them, 6 GB). Each run is a fresh process that loads the
checkpoint in bfloat16 (memory-mapped, as a user's run does) with the config cut to the first N decoder layers
(the files are the whole model's), forecasts its memory with ``lmpress.memory_plan``, runs GPTQ W4 g128 on those
N layers and records the stage's wall time per layer and the process's peak RSS. The whole model's time is
projected linearly in layers from the N-layer run and checked against one run over 2N layers.
Writes bench/results/scale.json and bench/results/scale.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SHARD_BYTES = 5 * 10**9  # the hub's max_shard_size for these checkpoints

RANDOM_CHECKPOINT = dict(  # what every shape's config here shares
    attention_bias=False,
    hidden_act="silu",
    initializer_range=0.02,
    torch_dtype="bfloat16",
    bos_token_id=1,
    eos_token_id=0,
)
LLAMA3 = dict(
    RANDOM_CHECKPOINT,
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    mlp_bias=False,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    vocab_size=128256,
    num_attention_heads=32,
    num_key_value_heads=8,
)
SHAPES = {
    "llama-3.2-1b": dict(
        LLAMA3,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        head_dim=64,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_scaling=dict(
            factor=32.0,
            high_freq_factor=4.0,
            low_freq_factor=1.0,
            original_max_position_embeddings=8192,
            rope_type="llama3",
        ),
    ),
    "llama-3-8b": dict(
        LLAMA3,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        head_dim=128,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
}
# Qwen3-30B-A3B: 128 experts a layer, 8 routed per token. Its checkpoint would take 61 GB: the one built here holds
# only its first STORED_LAYERS layers (and the embedding and head), enough for the runs; the whole model's forecast
# reads its config alone.
SHAPES["qwen3-30b-a3b"] = dict(
    RANDOM_CHECKPOINT,
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)
STORED_LAYERS = {"qwen3-30b-a3b": 4}
GPTQ = {"method": "gptq", "bits": 4, "group_size": 128, "symmetric": True}


def tensor_shapes(config: dict, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight of a Llama (or Qwen3-MoE: experts stored one tensor each) checkpoint with ``config``'s shapes
    and its first ``layers`` decoder layers, in the hub's order."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    moe = config["model_type"] == "qwen3_moe"
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        if moe:
            n, e_inter = config["num_experts"], config["moe_intermediate_size"]
            mlp = [(p + "mlp.gate.weight", (n, hidden))]
            for e in range(n):
                mlp += [
                    (p + f"mlp.experts.{e}.down_proj.weight", (hidden, e_inter)),
                    (p + f"mlp.experts.{e}.gate_proj.weight", (e_inter, hidden)),
                    (p + f"mlp.experts.{e}.up_proj.weight", (e_inter, hidden)),
                ]
        else:
            mlp = [
                (p + "mlp.down_proj.weight", (hidden, inter)),
                (p + "mlp.gate_proj.weight", (inter, hidden)),
                (p + "mlp.up_proj.weight", (inter, hidden)),
            ]
        norms = [(p + "self_attn.k_norm.weight", (head_dim,)), (p + "self_attn.q_norm.weight", (head_dim,))]
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            *mlp,
            (p + "post_attention_layernorm.weight", (hidden,)),
            *(norms if moe else []),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, q)),
            (p + "self_attn.q_proj.weight", (q, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def shard_plan(shapes: list[tuple[str, tuple[int, ...]]], limit: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors in order, a new shard whenever the next would take the current one past ``limit`` bytes."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = 2 * numel(shape)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def write_random_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], seed: int) -> None:
    """A bfloat16 safetensors file streamed tensor by tensor (norms 1, matrices N(0, 0.02)), never all in RAM."""
    import torch

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + 2 * numel(shape)]}
        offset += 2 * numel(shape)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    generator = torch.Generator().manual_seed(seed)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, shape in tensors:
            if len(shape) == 1:
                f.write(torch.ones(shape, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
                continue
            rows_per_chunk = max(1, (32 << 20) // shape[1])
            for start in range(0, shape[0], rows_per_chunk):
                rows = min(rows_per_chunk, shape[0] - start)
                chunk = torch.randn((rows, shape[1]), generator=generator).mul_(0.02).to(torch.bfloat16)
                f.write(chunk.view(torch.int16).numpy().tobytes())
    tmp.rename(path)


def write_tokenizer(path: Path) -> None:
    """A small byte-level BPE tokenizer (ids below every shape's vocabulary) for the calibration text."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<|eos|>", "<|bos|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([topics[k] for k in sorted(topics)], trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    wrapped.save_pretrained(path)


def build_checkpoint(shape: str) -> Path:
    """The random-weight checkpoint of ``shape`` (built once, then reused from the cache)."""
    from lmpress.cache import cache_root

    root = cache_root() / "scale" / shape
    if (root / "complete").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    config = SHAPES[shape]
    stored = STORED_LAYERS.get(shape, config["num_hidden_layers"])
    shards = shard_plan(tensor_shapes(config, stored), SHARD_BYTES)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    began = time.perf_counter()
    for seed, (name, tensors) in enumerate(zip(names, shards, strict=True)):
        if not (root / name).exists():
            print(f"  writing {shape}/{name} ({sum(2 * numel(s) for _, s in tensors) / 1e9:.2f} GB)", flush=True)
            write_random_safetensors(root / name, tensors, seed)
    if len(shards) > 1:
        weight_map = {tensor: name for name, tensors in zip(names, shards, strict=True) for tensor, _ in tensors}
        total = sum(2 * numel(s) for _, s in tensor_shapes(config, stored))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (root / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(root)
    (root / "complete").write_text(f"{time.perf_counter() - began:.0f} s\n")
    return root


def config_only(shape: str) -> Path:
    """A directory holding ``shape``'s config alone: the whole model, to forecast."""
    from lmpress.cache import cache_root

    path = cache_root() / "scale" / f"{shape}.config"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SHAPES[shape], indent=2))
    return path


def first_layers_view(checkpoint: Path, layers: int) -> Path:
    """A directory that reads ``checkpoint``'s files (links) with the config cut to its first ``layers`` layers."""
    stored = STORED_LAYERS.get(checkpoint.name, layers)
    if layers > stored:
        raise SystemExit(f"{checkpoint.name}: its checkpoint here holds only its first {stored} layers")
    view = checkpoint.parent / f"{checkpoint.name}.first{layers}"
    view.mkdir(exist_ok=True)
    for item in checkpoint.iterdir():
        if item.name in ("config.json", "complete"):
            continue
        link = view / item.name
        if not link.exists():
            link.symlink_to(item)
    config = json.loads((checkpoint / "config.json").read_text())
    (view / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    return view


# One measured run, in a fresh process so that its peak RSS is its own; prints one JSON line.
CHILD = """
import json, sys, time
import torch
from lmpress.api import quantize_model
from lmpress.memory import process_peak_mb
from lmpress.loader import load_model
from lmpress.progress import Bars

path, stage, data, device = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
torch.set_num_threads(int(sys.argv[5]))


class LayerClock(Bars):
    def __init__(self):
        super().__init__(enabled=False)
        self.stamps = []

    def track(self, items, description, total=None):
        for item in items:
            self.stamps.append((time.perf_counter(), time.process_time()))
            yield item
        self.stamps.append((time.perf_counter(), time.process_time()))


began = time.perf_counter()
loaded = load_model(path, "bfloat16", fingerprint=False)
loaded_s = time.perf_counter() - began
clock = LayerClock()
began = time.perf_counter()
quantize_model(loaded.model, loaded.tokenizer, data=data, bars=clock, device=device, **stage)
stage_s = time.perf_counter() - began
layer_s = [b[0] - a[0] for a, b in zip(clock.stamps, clock.stamps[1:])]
layer_cpu_s = [b[1] - a[1] for a, b in zip(clock.stamps, clock.stamps[1:])]
print(json.dumps({
    "load_s": loaded_s, "stage_s": stage_s, "layer_s": layer_s, "layer_cpu_s": layer_cpu_s,
    "peak_rss_mb": process_peak_mb(),
    "cuda_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
}))
"""


def add_forecast(row: dict, data: dict) -> dict:
    """``row`` with lmpress.memory_plan's forecast for its run (from the configs alone) and for the whole model."""
    import torch

    from lmpress.calib.moe import unfuse_experts
    from lmpress.loader import model_skeleton
    from lmpress.memory_plan import forecast_memory
    from lmpress.registry import stage_config

    config = stage_config(GPTQ["method"])(**GPTQ)
    whole = build_checkpoint(row["shape"])

    def forecast(path: Path):
        skeleton = model_skeleton(path, weights=any(path.glob("*.safetensors")))
        with torch.device("meta"):
            unfuse_experts(skeleton)  # a MoE's experts, one linear each, as a run and `lmpress forecast` count them
        return forecast_memory(
            skeleton, path, "bfloat16", [config], data["samples"], data["seq_len"], torch.device(row["device"])
        )

    run = forecast(first_layers_view(whole, row["layers"]))
    row["forecast_ram_mb"] = run.ram_bytes / 2**20
    row["forecast_device_mb"] = run.device_bytes / 2**20
    row["forecast_parts_mb"] = {k: v / 2**20 for k, v in run.parts.items()}
    whole_model = config_only(row["shape"]) if row["shape"] in STORED_LAYERS else whole
    row["forecast_whole_model_mb"] = forecast(whole_model).ram_bytes / 2**20
    row["forecast_vs_peak"] = row["forecast_ram_mb"] / row["peak_rss_mb"]
    return row


def measure(shape: str, layers: int, data: dict, device: str, threads: int) -> dict:
    view = first_layers_view(build_checkpoint(shape), layers)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", CHILD, str(view), json.dumps(GPTQ), json.dumps(data), device, str(threads)]
    load_before = os.getloadavg()[0]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    load_after = os.getloadavg()[0]
    if done.returncode != 0:
        raise SystemExit(f"{shape} with {layers} layers failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    total_layers = SHAPES[shape]["num_hidden_layers"]
    row.update(shape=shape, layers=layers, device=device, seconds_per_layer=row["stage_s"] / layers)
    row["load_average"] = [round(load_before, 2), round(load_after, 2)]  # 1-minute, at the run's start and end
    row["cpu_seconds_per_layer"] = sum(row["layer_cpu_s"]) / layers  # every thread's, robust to a busy machine
    row["projected_model_s"] = row["seconds_per_layer"] * total_layers
    row["projected_model_cpu_s"] = row["cpu_seconds_per_layer"] * total_layers
    return add_forecast(row, data)


def host() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return f"{model}, {os.cpu_count()} cores"


def markdown(rows: list[dict], data: dict, host_name: str) -> str:
    lines = [
        f"GPTQ W4 g128 (symmetric), calibration {data['samples']} x {data['seq_len']} tokens, "
        f"bfloat16 checkpoint memory-mapped; host: {host_name}.",
        "",
        "| shape | layers run | device | load average (start, end) | wall s / layer | CPU s / layer | "
        "projected whole model (wall) | peak RSS | forecast | forecast / peak | forecast, whole model |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        load = r.get("load_average")
        load = f"{load[0]:.1f}, {load[1]:.1f}" if load else "not recorded"
        lines.append(
            f"| {r['shape']} | {r['layers']} | {r['device']} | {load} | {r['seconds_per_layer']:.1f} | "
            f"{r['cpu_seconds_per_layer']:.1f} | {r['projected_model_s'] / 60:.1f} min | "
            f"{r['peak_rss_mb'] / 1024:.2f} GiB | {r['forecast_ram_mb'] / 1024:.2f} GiB | "
            f"{r['forecast_vs_peak']:.2f} | {r['forecast_whole_model_mb'] / 1024:.2f} GiB |"
        )
    checks = [r for r in rows if "projection_error" in r]
    if checks:
        lines += ["", "Projection check (time of the 2N-layer run against 2N x the N-layer run's s/layer):", ""]
        for r in checks:
            lines.append(
                f"- {r['shape']}: {r['layers']} layers took {r['stage_s']:.0f} s wall, projected "
                f"{r['projected_from_half_s']:.0f} s ({100 * r['projection_error']:+.1f}%); "
                f"{sum(r['layer_cpu_s']):.0f} CPU s, projected {r['projected_from_half_cpu_s']:.0f} "
                f"({100 * r['projection_cpu_error']:+.1f}%)"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--check-layers", type=int, default=None, help="the projection check run (default 2N; 0: none)")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    parser.add_argument(
        "--reforecast", type=Path, nargs="+", help="recompute the forecasts of these results files' rows into --out"
    )
    args = parser.parse_args()
    data = {"source": "builtin:python-docs", "samples": args.samples, "seq_len": args.seq_len, "seed": 0}
    if args.reforecast:
        results = [json.loads(path.read_text()) for path in args.reforecast]
        data = results[0]["data"]
        rows = [add_forecast(row, data) for result in results for row in result["rows"]]
        write_results(args.out, results[0]["host"], data, rows)
        return
    check = 2 * args.layers if args.check_layers is None else args.check_layers
    rows = []
    for shape in args.shapes:
        first = measure(shape, args.layers, data, args.device, args.threads)
        rows.append(first)
        print(json.dumps(first), flush=True)
        if check:
            second = measure(shape, check, data, args.device, args.threads)
            second["projected_from_half_s"] = first["seconds_per_layer"] * check
            second["projection_error"] = second["projected_from_half_s"] / second["stage_s"] - 1
            second["projected_from_half_cpu_s"] = first["cpu_seconds_per_layer"] * check
            second["projection_cpu_error"] = second["projected_from_half_cpu_s"] / sum(second["layer_cpu_s"]) - 1
            rows.append(second)
            print(json.dumps(second), flush=True)
    write_results(args.out, host(), data, rows)


def write_results(out: Path, host_name: str, data: dict, rows: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"host": host_name, "data": data, "rows": rows}, indent=2))
    out.with_suffix(".md").write_text(markdown(rows, data, host_name))
    print(markdown(rows, data, host_name))


if __name__ == "__main__":
    main()
