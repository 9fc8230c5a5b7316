"""CPU decode speed of lmpress's runtime on SmolLM2-135M against transformers and llama.cpp (issues 11, 41).

    python bench/runtime.py                    # the goal rows, 7 repeats: stdout and bench/results/runtime.{json,md}
    python bench/runtime.py --rows lmpress-w4-head8-compile llama.cpp-q4_1 --repeats 5 --new-tokens 128
    python bench/runtime.py --rows lmpress-w4-head8-compile lmpress-w4-head8-compile-kv8 llama.cpp-q4_1 \
        llama.cpp-q4_1-kv8 --prompt-tokens 4000 --new-tokens 64 --timing after-first --results kv_decode
        # long context (issue 50): float vs INT8 KV, llama.cpp's f16 and q8_0 caches: bench/results/kv_decode.md

Batch 1, a 128-token prompt (the start of the built-in Python docs text), 256 new tokens, greedy,
EOS ignored so every row decodes the same number of tokens. Every timed row runs in its own process
(so its peak RSS is its own), started and warmed up (compiled) first; then the rows are timed in
turn, one repeat of each per round (A, B, C, A, B, C, ...; the first row of a round rotates), so a
machine whose speed drifts slows them alike. Each repeat times 1 and N new tokens (decode tok/s =
(N - 1) / (t(N) - t(1)); with ``--timing after-first`` the N - 1 tokens after the first within one N-token
run, so a long prompt's prefill is not in it) and measures the copy bandwidth just before, in the same process; a row
reports the median and quartiles over repeats, with the load average at each. Bytes per token follow
``lmpress.runtime.throughput``: weights + KV cache at the mean length.

llama.cpp runs through llama-cpp-python in two builds where both exist: the one installed (``.ci/run``
builds it for AVX2; a plain ``pip install`` builds it for the host it runs on, and each row records the build's
own system info) and a native one (``-march=native`` without AMX; ``--build-llama-cpp`` builds it
once into ~/.cache/lmpress/llama-cpp/, about 5 minutes on 2 cores). The faster one is the reference. Its
threads are llama-cpp-python's own defaults, as its users run it (``--llama-cpp-threads same``: ``--threads``).
The ``*-same-*`` rows run identical codes in both engines: bench/serve.py's W4 g64 artifact with its 8-bit head,
as compressed-tensors for lmpress and as lmpress's GGUF (Q4_0, Q8_0 head) for llama.cpp (issue 55).
Results are filed per host kind (CPU model + instruction sets, ``runtime_hosts.py``).

The speculative rows decode a grounded prompt (rewrite a given block of code), where
the answer copies the prompt: prompt lookup drafts from it; the draft-model row drafts
with the W4 copy of the FP32 target. Their output is checked token for token against
plain decoding. They time themselves (plain and speculative interleaved) in one process each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_artifacts import (  # noqa: E402  (re-exported: other benches import them from here)
    ARTIFACT_SETTINGS,
    NATIVE_LLAMA_CPP,
    SMOLLM2,
    artifact,
    llama_cpp_builds,
    q4_1_gguf,
    q8_0_gguf,
    same_artifact,
)
from runtime_hosts import (  # noqa: E402
    cpu_identity,
    decode_rate,
    goals,
    record,
    render,
    round_orders,
    summarize,
    worker_environment,
)
from worker_process import WorkerProcess, reply  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_ROWS = [
    "lmpress-same-w4-head8-compile",
    "llama.cpp-same-w4-head8",
    "llama.cpp-same-w4-head8-native",
    "lmpress-w4-head8-compile",
    "llama.cpp-q4_1",
    "llama.cpp-q4_1-native",
    "lmpress-w8-compile",
    "llama.cpp-q8_0",
    "llama.cpp-q8_0-native",
]

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted by start."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    """Total length covered by the union of the intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))


def find_gaps(intervals, lower, upper):
    """The uncovered pieces of [lower, upper]."""
    gaps = []
    cursor = lower
    for start, end in merge_intervals(intervals):
        if start > cursor:
            gaps.append([cursor, min(start, upper)])
        cursor = max(cursor, end)
        if cursor >= upper:
            break
    if cursor < upper:
        gaps.append([cursor, upper])
    return gaps


def point_in_any(intervals, point):
    """Whether the point lies inside one of the intervals."""
    for start, end in merge_intervals(intervals):
        if start <= point <= end:
            return True
    return False
'''
GROUNDED_REQUEST = "Rewrite this Python code with type hints added to every function. Keep everything else the same."


# Rows (each runs in its own process) ---------------------------------------------------------------


def plain_prompt(tokenizer: Any, n_tokens: int) -> list[int]:
    from lmpress.runtime.throughput import bench_prompt

    return bench_prompt(tokenizer, n_tokens)


def grounded_prompt(tokenizer: Any) -> list[int]:
    message = f"{GROUNDED_REQUEST}\n\n```python\n{CODE}```"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# Timed rows: each builds, in its worker process, a function generating n tokens and the row's fixed facts ----------

Generate = Callable[[int], float | None]  # generates n tokens; returns when the first came (perf_counter) if it can


def timed_runtime(
    args: argparse.Namespace, source: str, dtype: str, compile: bool = False, kv_cache: str | None = None
) -> tuple[Generate, dict]:
    from lmpress.cli import kv_quant_flag
    from lmpress.runtime.generate import decoding_step, generate_tokens
    from lmpress.runtime.text import load_runtime
    from lmpress.runtime.throughput import kv_cache_bytes, layer_kernels, weight_bytes

    model, tokenizer = load_runtime(source, "cpu", dtype, args.activations)
    model.kv_quant = kv_quant_flag(kv_cache)
    prompt = plain_prompt(tokenizer, args.prompt_tokens)
    step = decoding_step(model.device, compile)  # the step lmpress generate and lmpress bench run

    def run(n: int) -> float | None:
        first = None
        for _ in generate_tokens(model, [prompt], max_new_tokens=n, step=step):
            first = first or time.perf_counter()
        return first

    kernels = sorted(set(layer_kernels(model).values()))
    per_token = weight_bytes(model) + kv_cache_bytes(model, len(prompt) + args.new_tokens // 2)
    info = {"prompt_tokens": len(prompt), "new_tokens": args.new_tokens, "bytes_per_token": per_token}
    info["kernels"], info["cpu_activations"] = kernels, args.activations
    info["kv_cache"] = "float" if model.kv_quant is None else model.kv_quant.describe()
    info["product_4_over_1"] = product_ratio(model, rows=4)
    return run, info


@torch.no_grad()
def product_ratio(model: Any, rows: int, repeats: int = 7) -> float:
    """Time of one pass over every linear layer of ``model`` with ``rows`` input rows over that with one (medians,
    interleaved): what a speculative verification of ``rows`` tokens costs in matmuls against one decode step."""
    linears = product_layers(model)
    inputs = {n: product_inputs(linears, n) for n in (1, rows)}

    def one_pass(n: int) -> float:
        began = time.perf_counter()
        for layer, x in zip(linears, inputs[n], strict=True):
            layer(x)
        return time.perf_counter() - began

    times: dict[int, list[float]] = {1: [], rows: []}
    for _ in range(repeats + 1):
        for n in times:
            times[n].append(one_pass(n))
    return statistics.median(times[rows][1:]) / statistics.median(times[1][1:])


def product_layers(model: Any) -> list[torch.nn.Module]:
    """Every linear product of a decode step of ``model``: its fused linears and the output head."""
    from lmpress.runtime.linears import FusedLinear

    return [m for m in model.modules() if isinstance(m, FusedLinear)] + [model.output]


def product_inputs(linears: list[torch.nn.Module], rows: int) -> list[torch.Tensor]:
    """One contiguous ``(rows, in_features)`` input per layer (a column slice of a wider input would be a strided
    view for several rows, copied inside the layer, and too narrow for a layer wider than the slice)."""
    widths = [getattr(layer, "in_features", None) or layer.parts[0].in_features for layer in linears]
    return [torch.randn(rows, k) for k in widths]


def timed_transformers(args: argparse.Namespace) -> tuple[Generate, dict]:
    import lmpress

    loaded = lmpress.load_model(SMOLLM2, "float32")
    model, config = loaded.model, loaded.model.config
    prompt = torch.tensor([plain_prompt(loaded.tokenizer, args.prompt_tokens)])

    def run(n: int) -> None:
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied parameters once
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    mean_length = prompt.shape[1] + args.new_tokens // 2
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * mean_length * 4
    return run, {"prompt_tokens": prompt.shape[1], "new_tokens": args.new_tokens, "bytes_per_token": weights + kv}


def timed_llama_cpp(
    args: argparse.Namespace, gguf: Callable[[], Path], build: str, kv_cache: str | None = None
) -> tuple[Generate, dict]:
    if build == "native":
        sys.path.insert(0, str(NATIVE_LLAMA_CPP))
    import llama_cpp
    from gguf import GGUFReader

    import lmpress

    path = gguf()
    tokenizer = lmpress.load_model(SMOLLM2).tokenizer  # the same token ids the other rows read
    prompt = plain_prompt(tokenizer, args.prompt_tokens)
    threads = None if args.llama_cpp_threads == "own" else torch.get_num_threads()  # None: llama-cpp-python's
    n_ctx = max(1024, len(prompt) + args.new_tokens + 16)
    cache = {}  # its own f16 cache by default; q8_0 K and V caches as its users set them (V needs flash attention)
    if kv_cache == "q8_0":
        cache = dict(type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_Q8_0, flash_attn=True)
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, **cache)

    def run(n: int) -> float | None:
        llm.reset()  # no prompt reuse between runs: every run prefills
        tokens, first = 0, None
        for _ in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            first = first or time.perf_counter()
            tokens += 1  # greedy; EOS is not special here, as in the other rows
            if tokens == n:
                break
        return first

    reader = GGUFReader(str(path))
    fields = {f.name: f.parts[f.data[0]][0] for f in reader.fields.values() if f.name.startswith("llama.")}
    names = {t.name for t in reader.tensors}
    # The weights a step reads: all but the embedding table, unless it is tied to the output (then read whole).
    weights = sum(
        int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight" or "output.weight" not in names
    )
    layers, kv_heads = int(fields["llama.block_count"]), int(fields["llama.attention.head_count_kv"])
    head_dim = int(fields["llama.embedding_length"]) // int(fields["llama.attention.head_count"])
    per_entry = 34 / 32 if kv_cache == "q8_0" else 2  # q8_0: 32 codes and a float16 scale in 34 bytes
    kv = 2 * layers * kv_heads * head_dim * (len(prompt) + args.new_tokens // 2) * per_entry
    info = {"prompt_tokens": len(prompt), "new_tokens": args.new_tokens, "bytes_per_token": weights + kv}
    info["kv_cache"] = kv_cache or "f16"
    info["llama_cpp"] = {"build": build, "path": llama_cpp.__file__, "system_info": system_info(llama_cpp)}
    info["threads"] = {"decode": llm.n_threads, "prompt": llm.n_threads_batch}
    return run, info


def system_info(llama_cpp: Any) -> str:
    text = llama_cpp.llama_print_system_info()
    return (text.decode() if isinstance(text, bytes) else str(text)).strip()


TIMED = {
    "transformers-fp32": ("transformers generate, FP32", lambda a: timed_transformers(a)),
    "lmpress-fp32": ("lmpress FP32", lambda a: timed_runtime(a, SMOLLM2, "float32")),
    "lmpress-fp32-compile": ("lmpress FP32 + torch.compile", lambda a: timed_runtime(a, SMOLLM2, "float32", True)),
    "lmpress-w4": (
        "lmpress W4 g64 (embedding/head FP32)",
        lambda a: timed_runtime(a, str(artifact("w4g64")), "float32"),
    ),
    "lmpress-w4-head8": (
        "lmpress W4 g64, head W8 (as Q4_1's Q8_0 head)",
        lambda a: timed_runtime(a, str(artifact("w4g64-head8")), "float32"),
    ),
    "lmpress-w4-head8-compile": (
        "lmpress W4 g64, head W8 + torch.compile",
        lambda a: timed_runtime(a, str(artifact("w4g64-head8")), "float32", True),
    ),
    "lmpress-w8-compile": (
        "lmpress W8 per row (head too) + torch.compile",
        lambda a: timed_runtime(a, str(artifact("w8-head8")), "float32", True),
    ),
    "lmpress-w4-head8-compile-kv8": (
        "lmpress W4 g64, head W8 + torch.compile, INT8 KV cache",
        lambda a: timed_runtime(a, str(artifact("w4g64-head8")), "float32", True, "int8"),
    ),
    "lmpress-w4-head8-compile-kv4": (
        "lmpress W4 g64, head W8 + torch.compile, INT4 KV cache (KIVI: keys per channel and 32 slots)",
        lambda a: timed_runtime(a, str(artifact("w4g64-head8")), "float32", True, "int4"),
    ),
    "lmpress-w4-head8-compile-kvfp8": (
        "lmpress W4 g64, head W8 + torch.compile, FP8 KV cache (E4M3, a scale per tensor)",
        lambda a: timed_runtime(a, str(artifact("w4g64-head8")), "float32", True, "fp8"),
    ),
    "lmpress-same-w4-head8-compile": (
        "lmpress W4 g64 sym, head W8, bfloat16 float tensors + torch.compile (the llama.cpp-same rows' codes)",
        lambda a: timed_runtime(a, str(same_artifact() / "ct"), "float32", True),
    ),
    "llama.cpp-same-w4-head8": (
        "llama.cpp on lmpress's GGUF of the same codes (Q4_0, Q8_0 head), installed build",
        lambda a: timed_llama_cpp(a, lambda: same_artifact() / "gguf" / "model.gguf", "avx2"),
    ),
    "llama.cpp-same-w4-head8-native": (
        "llama.cpp on lmpress's GGUF of the same codes (Q4_0, Q8_0 head), native build",
        lambda a: timed_llama_cpp(a, lambda: same_artifact() / "gguf" / "model.gguf", "native"),
    ),
    "llama.cpp-q4_1": (
        "llama.cpp Q4_1 (SmolLM2's GGUF), installed build",
        lambda a: timed_llama_cpp(a, q4_1_gguf, "avx2"),
    ),
    "llama.cpp-q4_1-kv8": (
        "llama.cpp Q4_1 (SmolLM2's GGUF), installed build, q8_0 K and V caches",
        lambda a: timed_llama_cpp(a, q4_1_gguf, "avx2", "q8_0"),
    ),
    "llama.cpp-q4_1-native": (
        "llama.cpp Q4_1 (SmolLM2's GGUF), native build",
        lambda a: timed_llama_cpp(a, q4_1_gguf, "native"),
    ),
    "llama.cpp-q8_0": (
        "llama.cpp Q8_0 (lmpress's GGUF), installed build",
        lambda a: timed_llama_cpp(a, q8_0_gguf, "avx2"),
    ),
    "llama.cpp-q8_0-native": (
        "llama.cpp Q8_0 (lmpress's GGUF), native build",
        lambda a: timed_llama_cpp(a, q8_0_gguf, "native"),
    ),
}


# Speculative rows (one process each; they interleave plain and speculative decoding themselves) ----------------------


def row_speculative(
    args: argparse.Namespace,
    draft_source: str | None,
    compile: bool = False,
    draft_vocab: int | None = None,
    draft_vocab_text: str = "builtin:python-docs",
) -> dict[str, Any]:
    from lmpress.runtime.text import load_draft, load_runtime
    from lmpress.runtime.throughput import BenchSettings, benchmark

    model, tokenizer = load_runtime(SMOLLM2, "cpu", "float32")
    draft = load_draft(
        draft_source, model, tokenizer, "cpu", "float32", draft_vocab, draft_vocab_text, args.activations
    )
    settings = BenchSettings(new_tokens=args.new_tokens, repeats=args.repeats, compile=compile)
    result = benchmark(model, grounded_prompt(tokenizer), settings, draft=draft, prompt_lookup=draft is None)
    return {**result["plain"], **{f"spec_{k}": v for k, v in result["speculative"].items()}}


SPECULATIVE = {
    "prompt-lookup": ("lmpress FP32, prompt-lookup speculative", lambda a: row_speculative(a, None)),
    "prompt-lookup-compile": (
        "lmpress FP32 + torch.compile, prompt-lookup speculative",
        lambda a: row_speculative(a, None, True),
    ),
    "draft-w4": (
        "lmpress FP32, W4 (head W8) draft speculative",
        lambda a: row_speculative(a, str(artifact("w4g64-head8"))),
    ),
    "draft-w4-compile": (
        "lmpress FP32 + torch.compile, W4 (head W8) draft speculative",
        lambda a: row_speculative(a, str(artifact("w4g64-head8")), True),
    ),
}
LABELS = {name: label for name, (label, _) in {**TIMED, **SPECULATIVE}.items()}


# Worker: one timed row in its own process, driven over stdin/stdout ------------------------------------------------


def worker(name: str, args: argparse.Namespace) -> None:
    from lmpress.runtime.throughput import copy_bandwidth_gbs, running_peak_mb

    run, info = TIMED[name][1](args)
    run(args.new_tokens)  # warm-up: compiles, fills caches
    reply({"ready": True})
    for command in sys.stdin:
        if command.strip() == "time":
            bandwidth = copy_bandwidth_gbs("cpu", megabytes=256, repeats=3)
            reply({**time_generation(run, args), "bw": bandwidth, "load": os.getloadavg()[0]})
        elif command.strip() == "finish":
            reply({**info, "peak_memory_mb": running_peak_mb(lambda: run(args.new_tokens), torch.device("cpu"))})
            return


def time_generation(run: Generate, args: argparse.Namespace) -> dict[str, float]:
    """One repeat: t(1) and t(N) from two runs, or (``--timing after-first``) one N-token run's first token and the
    time after it (rows that cannot tell when their first token came fall back to two runs)."""
    if args.timing == "after-first":
        began = time.perf_counter()
        first = run(args.new_tokens)
        end = time.perf_counter()
        if first is not None:
            return {"t1": first - began, "tn": end - began, "after_first": end - first}
    times = []
    for n in (1, args.new_tokens):
        began = time.perf_counter()
        run(n)
        times.append(time.perf_counter() - began)
    return {"t1": times[0], "tn": times[1]}


def start_worker(name: str, args: argparse.Namespace) -> WorkerProcess:
    argv = [sys.executable, __file__, "--worker", name, "--threads", str(args.threads)]
    argv += ["--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens)]
    argv += ["--activations", args.activations, "--llama-cpp-threads", args.llama_cpp_threads, "--timing", args.timing]
    return WorkerProcess(name, argv, worker_environment(dict(os.environ), REPO, args.omp_wait_policy))


def run_interleaved(names: list[str], args: argparse.Namespace) -> tuple[dict[str, dict], list[str]]:
    """Every row in ``names`` timed ``args.repeats`` times, one repeat of each per round; the failed rows named."""
    workers, failed = {}, []
    for name in names:  # started one at a time: loading and compiling do not overlap anyone's timing
        print(f"{name}: loading, warming up ...", file=sys.stderr, flush=True)
        worker_ = start_worker(name, args)
        try:
            worker_.ask(None)
            workers[name] = worker_
        except RuntimeError as error:
            print(error, file=sys.stderr)
            worker_.close()
            failed.append(name)
    samples: dict[str, list[dict]] = {name: [] for name in workers}
    try:
        for round_, (order, counted) in enumerate(round_orders(list(workers), args.repeats, args.warmup_rounds)):
            for name in order:
                if name in failed:
                    continue
                try:
                    sample = workers[name].ask("time")
                except RuntimeError as error:
                    print(error, file=sys.stderr)
                    failed.append(name)
                    continue
                if counted:
                    samples[name].append(sample)
                rate = decode_rate(sample, args.new_tokens)
                which = f"round {round_ + 1 - args.warmup_rounds}" if counted else "warm-up round"
                print(
                    f"  {which}: {name} {rate:.1f} tok/s, copy {sample['bw']:.1f} GB/s, load {sample['load']:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
        rows = {}
        for name, worker_ in workers.items():
            if name not in failed:
                rows[name] = summarize(samples[name], args.new_tokens, worker_.ask("finish"))
    finally:
        for worker_ in workers.values():
            worker_.close()
    return rows, failed


def run_speculative(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        argv = [sys.executable, __file__, "--row", name, "--out", out.name, "--threads", str(args.threads)]
        argv += ["--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
        argv += ["--prompt-tokens", str(args.prompt_tokens), "--activations", args.activations]
        env = worker_environment(dict(os.environ), REPO, args.omp_wait_policy)
        done = subprocess.run(argv, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            print(f"{name}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            return None
        return json.loads(Path(out.name).read_text())


def render_speculative(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| speculative | plain tok/s | speculative tok/s | speedup | acceptance | tokens/step | same output |"]
    lines.append("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        lines.append(
            f"| {LABELS[name]} | {r['spec_plain_decode_tok_s']:.1f} | {r['spec_decode_tok_s']:.1f} | "
            f"{r['spec_speedup']:.2f}x | {r['spec_acceptance_rate']:.2f} | {r['spec_tokens_per_target_step']:.2f} | "
            f"{'yes' if r['spec_identical_to_plain'] else 'NO'} |"
        )
    return "\n".join(lines)


def capped_threads(requested: int) -> int:
    cores = os.cpu_count() or 1
    if requested > cores:
        warnings.warn(f"--threads {requested} is more than this machine's {cores} cores: using {cores}", stacklevel=2)
        return cores
    if requested < 1:
        raise SystemExit(f"--threads must be at least 1, got {requested}")
    return requested


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7, help="rounds over the rows (at least 5 for the results page)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rows", nargs="+", choices=[*TIMED, *SPECULATIVE], default=DEFAULT_ROWS)
    parser.add_argument(
        "--activations",
        choices=["int8", "bf16"],
        default="int8",
        help="lmpress rows: weight-only layers' CPU activations (int8 per 4 values: lmpress's kernels; bf16: torch's)",
    )
    parser.add_argument(
        "--llama-cpp-threads",
        choices=("own", "same"),
        default="own",
        help="llama.cpp rows: llama-cpp-python's own thread defaults, as its users run it (half the logical CPUs "
        "for decode; the default), or --threads, as lmpress's rows",
    )
    parser.add_argument(
        "--timing",
        choices=("two-runs", "after-first"),
        default="two-runs",
        help="decode tok/s from t(1) and t(N) over two runs, or from the tokens after the first within one N-token "
        "run (after-first: for long prompts, whose prefill's spread swamps the decode steps)",
    )
    parser.add_argument(
        "--results", default="runtime", help="the results file's name in bench/results (runtime: the main page)"
    )
    parser.add_argument("--warmup-rounds", type=int, default=1, help="timed rounds run first and discarded")
    parser.add_argument(
        "--omp-wait-policy",
        choices=["PASSIVE", "default"],
        default="default",
        help="the rows' OpenMP threads spin a while before they sleep (libgomp's default, as users run each engine) "
        "or sleep at once (PASSIVE: for a machine loaded by other work)",
    )
    parser.add_argument("--build-llama-cpp", action="store_true", help="build the native llama.cpp once if missing")
    parser.add_argument("--no-record", action="store_true", help="print only; leave bench/results as it is")
    parser.add_argument("--worker", choices=list(TIMED), help=argparse.SUPPRESS)  # internal: one timed row
    parser.add_argument("--row", choices=list(SPECULATIVE), help=argparse.SUPPRESS)  # internal: a speculative row
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.threads = capped_threads(args.threads)
    torch.set_num_threads(args.threads)
    if args.worker:
        return worker(args.worker, args)
    if args.row:
        Path(args.out).write_text(json.dumps(SPECULATIVE[args.row][1](args)))
        return None
    builds = llama_cpp_builds(args.build_llama_cpp)
    rows = list(dict.fromkeys(args.rows))
    for name in [n for n in rows if n.startswith("llama.cpp")]:
        if ("native" if name.endswith("-native") else "avx2") not in builds:
            print(f"{name} skipped: that llama-cpp-python build is missing (--build-llama-cpp)", file=sys.stderr)
            rows.remove(name)
    for label in ARTIFACT_SETTINGS:
        artifact(label)  # made before any row is timed
    if any(n.startswith("llama.cpp-q8_0") for n in rows):
        q8_0_gguf()
    timed, failed = run_interleaved([n for n in rows if n in TIMED], args)
    speculative = {}
    for name in [n for n in rows if n in SPECULATIVE]:
        result = run_speculative(name, args)
        if result is None:
            failed.append(name)
        else:
            speculative[name] = result
    table = render(timed, LABELS)
    if speculative:
        table += "\n\n" + render_speculative(speculative)
    summary = goals(timed, LABELS)
    host = cpu_identity()
    print(f"{host['key']}, {args.threads} threads, load average {os.getloadavg()}\n\n{table}\n\n" + "\n".join(summary))
    if failed:
        sys.exit(f"rows failed: {', '.join(failed)}; bench/results left as they were")
    if args.no_record or args.repeats < 5:
        print("not recorded (--no-record, or fewer than 5 repeats)", file=sys.stderr)
        return None
    meta = {
        "model": SMOLLM2,
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "warmup_rounds": args.warmup_rounds,
        "omp_wait_policy": args.omp_wait_policy,
        "cpu_activations": args.activations,
        "timing": args.timing,
        "interleaved": True,
        "torch": torch.__version__,
        "load_average": os.getloadavg(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "llama_cpp_builds": {LABELS[n]: timed[n]["llama_cpp"]["system_info"] for n in timed if "llama_cpp" in timed[n]},
    }
    entry = {"meta": meta, "rows": {**timed, **speculative}, "goals": summary}
    record(RESULTS / f"{args.results}.json", host, entry, LABELS)
    return None


if __name__ == "__main__":
    main()
