"""A run's EAGLE-3 head scored at several continuation lengths (issue 53): does tokens per target pass grow with
how far the continuation runs?

    python bench/accept_by_length.py runs/eagle-w4                  # 64, 128 and 192 new tokens
    python bench/accept_by_length.py runs/eagle-w4 --lengths 64 192 --prompts 16

Why: the ``draft_head`` stage scores its held-out continuations (192 new tokens each) at more tokens per pass than
``eval.speculation`` measures on its test prompts (64 new tokens). A small model's later tokens repeat more, so
the length alone may explain part of the gap; this measures it on one head.

Protocol: the run's compressed-tensors export and its ``draft-head/`` on lmpress's runtime (CPU kernels, this
machine's threads, as ``lmpress generate --draft-head`` loads them), ``eval.speculation``'s prompts
(``--prompts`` windows of ``--prompt-tokens`` spread over ``--text``), greedy, a fixed ``--k`` drafts a round
(``accept_length``'s protocol; at the eval's settings it gives the run's ``accept_length``). Each prompt is decoded
once per length; ``per_pass`` = tokens / target passes. ``beyond_first`` is the span past the shortest length (the
longest length's extra tokens over its extra passes): what the later tokens alone score, to within the round the
shorter decode cut at its end. Writes bench/results/accept_by_length.json (one entry per run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lmpress, before an installed one
from quant_table import cpu_description  # noqa: E402

from lmpress.data import load_text  # noqa: E402
from lmpress.evals.speculation import SpeculationConfig, eval_prompts  # noqa: E402
from lmpress.runtime.speculative import SpeculativeStats, speculative_decode  # noqa: E402
from lmpress.runtime.text import draft_head_for, load_runtime  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "accept_by_length.json"


def score(run: Path, lengths: list[int], prompts: int, prompt_tokens: int, k: int, text: str) -> dict:
    export = str(run / "compressed-tensors")
    model, tokenizer = load_runtime(export)
    head = draft_head_for(str(run / "draft-head"), export, model)
    ids = torch.tensor(tokenizer.encode(load_text(text).text, add_special_tokens=False))
    windows = eval_prompts(ids, prompts, prompt_tokens)
    rows = {}
    for length in lengths:
        stats = SpeculativeStats()
        for prompt in windows:
            list(speculative_decode(model, prompt, draft_head=head, max_new_tokens=length, k=k, adaptive=False,
                                    stats=stats))  # fmt: skip
        rows[length] = {"tokens": stats.step_tokens, "passes": stats.target_steps, "per_pass": stats.tokens_per_step}
        print(f"{length:4d} new tokens: {stats.tokens_per_step:.3f} tokens per pass", flush=True)
    first, last = rows[lengths[0]], rows[lengths[-1]]
    later = (last["tokens"] - first["tokens"]) / max(last["passes"] - first["passes"], 1)
    print(f"beyond the first {lengths[0]}: {later:.3f} tokens per pass", flush=True)
    return {"run": str(run), "host": cpu_description(), "text": text, "prompts": prompts,
            "prompt_tokens": prompt_tokens, "k": k, "lengths": rows, "beyond_first": later}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder with compressed-tensors/ and draft-head/")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 192])
    parser.add_argument("--prompts", type=int, default=SpeculationConfig().prompts)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--text", default="builtin:wikitext2:test")
    args = parser.parse_args()
    entry = score(args.run, sorted(args.lengths), args.prompts, args.prompt_tokens, args.k, args.text)
    entries = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    RESULTS.write_text(json.dumps([*entries, entry], indent=1) + "\n")


if __name__ == "__main__":
    main()
