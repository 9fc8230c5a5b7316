"""Would tree drafting pay on this CPU? (issue 53: chain drafting, and tree drafting where it pays, measured.)

    python bench/draft_tree.py [--prompts 256] [--repeats 5]

The head: the ``draft_head`` stage's defaults trained on ``bench/draft_head_training.py``'s capture (the W4 g64
head-W8 SmolLM2's own continuations of ``--prompts`` WikiText-2 valid prompts, cached), scored on its 16 held-out
continuations. A tree keeps the head's top ``b_j`` choices at drafting step ``j`` and continues each kept branch
as a chain: branching ``(b0, b1, b2)`` drafts ``b0 + b0 b1 + b0 b1 b2`` tokens, verified in one target read of
that many tokens and one more. A round accepts step ``j``'s draft when the target's token is among the head's top
``b_j`` there and every earlier step's was (the training-time test's chain reads the target's own tokens, which is
what an accepted branch continues from), and rounds follow each other as decoding runs them
(``draft_head.decoding_accept_length``: for the chain, the tokens per pass speculative decoding measures on the
same continuations). The target's read
of N tokens is timed compiled (the runtime's fixed graphs up to 4 tokens, its symbolic graph beyond), interleaved
with a one-token step, medians over ``--repeats``. The bound a tree can reach: tokens per pass divided by the read's
cost in steps (drafting taken as free). Results: ``bench/results/draft_tree.{json,md}``, one entry per host.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_head import W4_HEAD8  # noqa: E402
from draft_head_training import HELD_OUT, captured  # noqa: E402
from quant_table import SMOLLM2  # noqa: E402
from runtime_hosts import cpu_identity, file_host_entry  # noqa: E402

import lmpress  # noqa: E402
from lmpress.distill.draft_head import decoding_accept_length, draft_hits  # noqa: E402
from lmpress.distill.draft_head_stage import DraftHeadConfig, train_head_for  # noqa: E402
from lmpress.loader import load_model  # noqa: E402
from lmpress.progress import Bars  # noqa: E402
from lmpress.runtime.eagle3 import Eagle3Config  # noqa: E402
from lmpress.runtime.generate import decoding_forward, prefill  # noqa: E402
from lmpress.runtime.model import Transformer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "draft_tree.json"
TREES = [(1, 1, 1), (2, 1, 1), (3, 1, 1), (2, 2, 1), (4, 1, 1)]


def drafts_of(branching: tuple[int, ...]) -> int:
    """Tokens a tree of ``branching`` drafts: each level keeps ``b`` choices below every node of the last."""
    total, width = 0, 1
    for b in branching:
        width *= b
        total += width
    return total


@torch.inference_mode()
def read_times(target: Transformer, counts: list[int], repeats: int, steps: int = 48) -> dict[int, float]:
    """ms of a compiled read of each of ``counts`` tokens after a 128-token prompt, interleaved, medians."""
    forward = decoding_forward(target.device, compile=True)
    prompt = torch.randint(100, target.args.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(1, 128 + max(counts) + 1)
    prefill(target, prompt, cache)
    times: dict[int, list[float]] = {n: [] for n in counts}
    for repeat in range(repeats + 1):  # the first: compiles and warms up
        for n in counts:
            tokens = torch.full((1, n), 500)
            began = time.perf_counter()
            for _ in range(steps):
                forward(target, tokens, cache)
                cache.truncate(128)
            if repeat:
                times[n].append(1e3 * (time.perf_counter() - began) / steps)
    return {n: statistics.median(t) for n, t in times.items()}


def render(hosts: dict) -> str:
    lines = [
        "Measured by `python bench/draft_tree.py` (the W4 g64 head-W8 SmolLM2 target; a head trained with the "
        "`draft_head` stage's defaults, scored on held-out continuations).\n"
    ]
    for key, entry in hosts.items():
        lines.append(
            f"## {key}\n\n{entry['when']}, {entry['threads']} threads, {entry['prompts']} prompts, load "
            f"average {entry['load']}; a one-token step {entry['step_ms']:.2f} ms.\n"
        )
        lines.append(
            "| tree (top b per step) | drafts | tokens per pass | target read, ms | read / step | "
            "bound: tokens per pass / read's steps |\n| --- | --- | --- | --- | --- | --- |"
        )
        for row in entry["rows"]:
            lines.append(
                f"| {row['tree']} | {row['drafts']} | {row['tokens_per_pass']:.3f} | {row['read_ms']:.2f} | "
                f"{row['read_steps']:.2f} | {row['bound']:.2f}x |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    loaded = load_model(SMOLLM2, "float32", fingerprint=False)
    model = copy.deepcopy(loaded.model)
    lmpress.quantize_model(model, **W4_HEAD8)
    target = Transformer.from_hf(model)
    config = DraftHeadConfig(prompts=args.prompts, held_out=HELD_OUT)
    head_config = Eagle3Config.for_target(target, model.config, config.draft_vocab)
    with Bars() as bars:
        data = captured(target, loaded.tokenizer, args.prompts, head_config.feature_layers, bars)
        head, _ = train_head_for(target, model, data, config, head_config, bars)
    head.eval()
    held_out = data.split(HELD_OUT)[1]
    first = config.prompt_tokens - 1  # decoding's first round drafts after the prompt
    accepted = {tree: decoding_accept_length(draft_hits(head, target, held_out, 3, tree), first) for tree in TREES}
    counts = [1] + sorted({drafts_of(tree) + 1 for tree in TREES})
    reads = read_times(target, counts, args.repeats)
    rows = []
    for tree in TREES:
        read = reads[drafts_of(tree) + 1]
        rows.append(
            {
                "tree": str(tree),
                "drafts": drafts_of(tree),
                "tokens_per_pass": accepted[tree],
                "read_ms": read,
                "read_steps": read / reads[1],
                "bound": accepted[tree] * reads[1] / read,
            }
        )
    entry = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "threads": torch.get_num_threads(),
        "prompts": args.prompts,
        "load": f"{os.getloadavg()[0]:.2f}",
        "step_ms": reads[1],
        "rows": rows,
    }
    print(file_host_entry(RESULTS, cpu_identity()["key"], entry, render))


if __name__ == "__main__":
    main()
