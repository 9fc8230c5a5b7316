"""`lmpress generate` as a user runs it, beside `lmpress bench` on the same export (issue 54, part 5).

Each `lmpress generate` is a fresh process, timed as its own summary line reports it: seconds from the command's
start to the first token (the goal: <= 5 s on SmolLM2 once the kernels are built) and the decode rate after the
first token, which should agree with `lmpress bench`'s on the same export, prompt and threads (within 15%).
Eager and compiled (``--compile``) are both run; the generate runs and the bench runs alternate. Results go to
``bench/results/generate_speed.{json,md}``, one entry per host (``bench/runtime_hosts.py``'s name) and export
format.

    python bench/generate_speed.py [ARTIFACT ...] [--runs 3] [--threads 2]

The default artifact is bench/serve.py's (SmolLM2 W4 g64 with its bfloat16 head: run ``bench/serve.py --group 64
--head float --float-dtype bfloat16`` once first); the quickstart's two exports (``lmpress run
recipes/quickstart.yaml --out runs/quickstart``: ``runs/quickstart/compressed-tensors runs/quickstart/gguf``) time
each format's load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_hosts import cpu_identity, file_host_entry  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SERVE_ARTIFACT = Path(os.path.expanduser("~/.cache/lmpress/bench/serve-w4g64-headfloat-bf16/ct"))
SUMMARY = re.compile(
    r"(?P<tokens>\d+) new tokens after a (?P<prompt>\d+)-token prompt: loaded in (?P<load>[\d.]+) s, "
    r"(?:compiled its decode step in (?P<compile>[\d.]+) s, )?first token (?P<first>[\d.]+) s later "
    r"\((?P<since_start>[\d.]+) s after the command started\), then (?P<rate>[\d.]+) tok/s"
)


def prompt_text(characters: int = 600) -> str:
    """The start of the built-in Python docs text, as `lmpress bench` takes its default prompt from (about 128
    tokens of SmolLM2's tokenizer)."""
    from lmpress.data import BUILTIN_PYTHON_DOCS, load_text

    return load_text(BUILTIN_PYTHON_DOCS).text[:characters]


def lmpress(*argv: str, threads: int) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    return subprocess.run([sys.executable, "-m", "lmpress", *argv], capture_output=True, text=True, env=env, check=True)


def run_generate(artifact: Path, prompt: str, new_tokens: int, compiled: bool, threads: int) -> dict[str, float]:
    began = time.perf_counter()
    done = lmpress(
        "generate",
        str(artifact),
        "--prompt",
        prompt,
        "--max-new-tokens",
        str(new_tokens),
        *(["--compile"] * compiled),
        threads=threads,
    )
    wall = time.perf_counter() - began
    found = SUMMARY.search(" ".join(done.stderr.split()))  # the console wraps its lines
    if found is None:
        raise RuntimeError(f"no summary line in lmpress generate's output:\n{done.stderr[-2000:]}")
    return {key: float(value or 0) for key, value in found.groupdict().items()} | {"wall_s": wall}


def run_bench(artifact: Path, prompt: str, new_tokens: int, compiled: bool, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "bench.json"
        lmpress(
            "bench",
            str(artifact),
            "--prompt",
            prompt,
            "--new-tokens",
            str(new_tokens),
            "--json",
            str(out),
            *(["--compile"] * compiled),
            threads=threads,
        )
        return json.loads(out.read_text())


def decode_rate_of(bench: dict[str, Any]) -> float:
    return float(bench["plain"]["decode_tok_s"])


def render(hosts: dict[str, Any]) -> str:
    pages = [
        "Measured by `python bench/generate_speed.py`: `lmpress generate` in fresh processes beside `lmpress bench`, "
        "runs alternating; medians.\n"
    ]
    for key, entry in hosts.items():
        meta = entry["meta"]
        artifact = f"{meta['artifact']} ({meta.get('format', 'compressed-tensors')})"
        pages.append(
            f"## {key}\n\n{artifact}; {meta['threads']} threads, {meta['new_tokens']} new tokens, "
            f"{meta['runs']} runs each, {meta['when']}, load average {meta['load']}.\n"
        )
        pages.append(
            "| step | generate: command start to first token s (goal <= 5) | generate: load s | generate: compile s | "
            "generate tok/s | bench tok/s | generate / bench (goal within 15%) |"
        )
        pages.append("| --- | --- | --- | --- | --- | --- | --- |")
        for step, row in entry["steps"].items():
            pages.append(
                f"| {step} | {row['since_start_s']:.2f} | {row['load_s']:.2f} | {row.get('compile_s', 0):.1f} | "
                f"{row['generate_tok_s']:.1f} | "
                f"{row['bench_tok_s']:.1f} | {row['generate_tok_s'] / row['bench_tok_s']:.2f}x |"
            )
        pages.append("")
    return "\n".join(pages) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="*", type=Path, default=[SERVE_ARTIFACT])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    for artifact in args.artifacts:
        if not artifact.is_dir():
            sys.exit(f"{artifact}: no export there (run bench/serve.py --group 64 --head float --float-dtype bfloat16)")
    for artifact in args.artifacts:
        time_artifact(artifact, args)


def export_format_of(artifact: Path) -> str:
    """The export's format: a single-file format's name, or its config's quantization method (dense: ``hf``)."""
    from lmpress.checkpoint_files import quant_method, read_config
    from lmpress.registry import artifact_format

    single = artifact_format(artifact)
    if single is not None:
        return single.name
    return quant_method(read_config(artifact)) or "hf"


def time_artifact(artifact: Path, args: argparse.Namespace) -> None:
    prompt = prompt_text()
    lmpress("generate", str(artifact), "--prompt", "warm", "--max-new-tokens", "2", threads=args.threads)
    steps = {}
    for compiled in (False, True):
        generated, benched = [], []
        for run in range(args.runs):
            print(f"{'compiled' if compiled else 'eager'} run {run + 1}/{args.runs}", file=sys.stderr, flush=True)
            generated.append(run_generate(artifact, prompt, args.new_tokens, compiled, args.threads))
            benched.append(decode_rate_of(run_bench(artifact, prompt, args.new_tokens, compiled, args.threads)))
        steps["compiled" if compiled else "eager"] = {
            "since_start_s": statistics.median(g["since_start"] for g in generated),
            "load_s": statistics.median(g["load"] for g in generated),
            "compile_s": statistics.median(g["compile"] for g in generated),
            "first_token_s": statistics.median(g["first"] for g in generated),
            "generate_tok_s": statistics.median(g["rate"] for g in generated),
            "bench_tok_s": statistics.median(benched),
            "generate_runs": generated,
            "bench_runs_tok_s": benched,
        }
    meta = {
        "host": cpu_identity(),
        "artifact": str(artifact),
        "format": export_format_of(artifact),
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": f"{os.getloadavg()[0]:.2f}",
    }
    entry = {"meta": meta, "steps": steps}
    key = f"{meta['host']['key']}, {meta['format']}"
    print(file_host_entry(args.results / "generate_speed.json", key, entry, render))


if __name__ == "__main__":
    main()
