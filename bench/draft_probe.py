"""What limits a speculative draft: what a round costs, and how often its greedy token is the target's.

    python bench/draft_probe.py                                   # the draft-student run of bench/distill_table.py
    python bench/draft_probe.py --draft runs/draft-student/compressed-tensors
    python bench/draft_probe.py --draft-vocab 16384   # the draft scoring the 16,384 tokens most frequent in its text

Agreement is teacher-forced (both models read the same tokens; a position agrees when their
argmax is the same), on two texts:

- ``copy``: a passage of the CPython reference text (the test split, which the draft never
  trains on) followed by the same passage again, scored on the repeat: a model that reads its
  context copies it; the target's agreement with the text itself is given beside it.
- ``answer``: the target's own greedy answer to bench/runtime.py's code-rewrite prompt (what the
  speculative benchmark decodes), scored on the answer.

Also times what a speculative round costs: the target's read of 1-5 tokens (its verification of
0-4 drafts) and the draft's of 1-2, eager and with ``compiled_forward``, after a 440-token context;
and the same reads inside compiled speculative decoding of that prompt (``loop_*``: there the
target's weights pass through the caches between the draft's steps), with the draft's read of the prompt.
Writes bench/results/draft_probe.json (draft_probe_vocabN.json with --draft-vocab N; 2 CPU threads).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_table import cpu_description  # noqa: E402
from runtime import SMOLLM2, grounded_prompt  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
DEFAULT_DRAFT = REPO / "runs" / "bench-distill" / "draft-student" / "compressed-tensors"
THREADS = 2


@torch.no_grad()
def greedy_tokens(model, ids: list[int]) -> torch.Tensor:
    """The model's argmax after each prefix of ``ids``, in one forward (token ids of the whole vocabulary)."""
    from lmpress.runtime.speculative import whole_vocabulary

    return whole_vocabulary(model, model(torch.tensor([ids]), model.new_cache(1, len(ids)))[0]).argmax(-1)


@torch.no_grad()
def greedy_answer(model, prompt: list[int], n: int) -> list[int]:
    from lmpress.runtime.generate import generate

    return generate(model, prompt, max_new_tokens=n)[0]  # EOS not special, as in the speculative benchmark


@torch.no_grad()
def forward_ms(model, n: int, forward=None, context: int = 440, repeats: int = 20) -> float:
    """Median ms of one read of ``n`` tokens after ``context`` (a speculative round's verification for n > 1)."""
    from lmpress.runtime.generate import model_forward
    from lmpress.runtime.throughput import median_seconds

    forward = forward or model_forward
    cache = model.new_cache(1, context + n)
    model(torch.arange(context)[None] + 100, cache)
    tokens = torch.full((1, n), 5)

    def read() -> None:
        cache.truncate(context)
        forward(model, tokens, cache)

    read()  # a compiled forward compiles here
    return 1000 * median_seconds(read, repeats, torch.device("cpu"))


def round_costs(target, draft) -> dict[str, float]:
    """What a round costs, eager and compiled: the target's read of 1-5 tokens, the draft's of 1 and 2."""
    from lmpress.runtime.generate import compiled_forward

    costs = {}
    for mode, forward in (("eager", None), ("compiled", compiled_forward())):
        for n in (1, 2, 3, 4, 5):
            costs[f"{mode}_target_{n}_tokens_ms"] = round(forward_ms(target, n, forward), 2)
        for n in (1, 2):
            costs[f"{mode}_draft_{n}_tokens_ms"] = round(forward_ms(draft, n, forward), 2)
    return costs


@torch.no_grad()
def in_loop_costs(target, draft, prompt: list[int], new_tokens: int = 256, runs: int = 3) -> dict[str, float]:
    """Compiled speculative decoding of ``prompt`` as the benchmark runs it, each read timed where it happens:
    the draft's and the target's steps (medians over the last of ``runs`` runs), the draft's prompt read."""
    import statistics

    from lmpress.runtime.generate import compiled_forward
    from lmpress.runtime.speculative import SpeculativeStats, compile_rounds, speculative_decode

    compiled, times = compiled_forward(), {}
    compile_rounds(compiled, target, draft, len(prompt), new_tokens)  # as the benchmark does before it times

    def timed(model, tokens, cache):
        began = time.perf_counter()
        logits = compiled(model, tokens, cache)
        times.setdefault(("draft" if model is draft else "target", tokens.shape[1]), []).append(
            time.perf_counter() - began
        )
        return logits

    for _ in range(runs):
        times.clear()
        stats = SpeculativeStats()
        list(speculative_decode(target, prompt, draft=draft, max_new_tokens=new_tokens, stats=stats, forward=timed))
    cache = draft.new_cache(1, len(prompt))
    began = time.perf_counter()
    draft(torch.tensor([prompt]), cache, last_only=True)
    costs = {"loop_draft_prompt_read_s": round(time.perf_counter() - began, 3)}
    for (who, n), seconds in sorted(times.items()):
        if who == "draft" or len(seconds) >= 5:
            costs[f"loop_{who}_{n}_tokens_ms"] = round(1000 * statistics.median(seconds), 2)
    costs["loop_tokens_per_target_step"] = round(stats.tokens_per_step, 2)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT))
    parser.add_argument("--passage-tokens", type=int, default=150)
    parser.add_argument("--passages", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, help="the draft scores only this many tokens (restrict_vocabulary)")
    parser.add_argument("--draft-vocab-text", default="builtin:python-source", help="text whose tokens are counted")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    from lmpress.data import load_text
    from lmpress.runtime.text import load_draft, load_runtime

    target, tokenizer = load_runtime(SMOLLM2, "cpu", "float32")
    draft = load_draft(args.draft, target, tokenizer, "cpu", "float32", args.draft_vocab, args.draft_vocab_text)
    text = load_text("builtin:python-docs", default_split="test").text[:40_000]
    text = tokenizer(text, add_special_tokens=False)["input_ids"]
    n, sep = args.passage_tokens, tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    copy_draft = copy_target_text = 0.0
    for i in range(args.passages):
        passage = text[i * 2 * n : i * 2 * n + n]
        ids = passage + sep + passage
        start = n + len(sep) - 1  # predictions of the repeat's tokens
        t, d = greedy_tokens(target, ids)[start:-1], greedy_tokens(draft, ids)[start:-1]
        copy_draft += float((d == t).float().mean()) / args.passages
        copy_target_text += float((t == torch.tensor(ids[start + 1 :])).float().mean()) / args.passages
    prompt = grounded_prompt(tokenizer)
    answer = greedy_answer(target, prompt, 256)
    ids = prompt + answer
    start = len(prompt) - 1
    t, d = greedy_tokens(target, ids)[start:-1], greedy_tokens(draft, ids)[start:-1]
    result = {
        "draft": str(Path(args.draft).resolve().relative_to(REPO))
        if Path(args.draft).resolve().is_relative_to(REPO)
        else args.draft,
        "draft_vocab": args.draft_vocab and {"tokens": args.draft_vocab, "text": args.draft_vocab_text},
        "cpu": cpu_description(),
        "threads": THREADS,
        **round_costs(target, draft),
        **in_loop_costs(target, draft, grounded_prompt(tokenizer)),
        "copy_draft_agrees_with_target": round(copy_draft, 3),
        "copy_target_agrees_with_text": round(copy_target_text, 3),
        "answer_draft_agrees_with_target": round(float((d == t).float().mean()), 3),
        "answer_target_self_check": round(float((t == torch.tensor(answer)).float().mean()), 3),
    }
    name = f"draft_probe_vocab{args.draft_vocab}.json" if args.draft_vocab else "draft_probe.json"
    (RESULTS / name).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
