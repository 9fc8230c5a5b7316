"""EAGLE-3 draft heads on SmolLM2-135M (issue 53): a head trained for the W4 target against one trained for the
float model, their acceptance on held-out WikiText-2 and on chat prompts, and the speed of speculative decoding.

    python bench/draft_head.py                         # both heads with the draft_head stage's defaults
    python bench/draft_head.py --prompts 128 --new-tokens 128 --epochs 2

Protocol. Targets: SmolLM2-135M-Instruct in float32 and its RTN W4 g64 (asymmetric, the head W8 per row), run by
lmpress's runtime (CPU kernels, int8 activations) on this machine's threads. Each head: the ``draft_head`` stage
(``train_head_for``) on the target's greedy continuations of ``--prompts`` WikiText-2 valid windows
(``--prompt-tokens`` + ``--new-tokens``). Acceptance: greedy, 3 drafts per round (fixed, so heads compare on
equal terms), over ``--eval-prompts`` WikiText-2 test windows of 64 tokens and as many chat prompts in SmolLM2's
chat template (default 32 each), 64 new tokens each; tokens per target pass = accepted drafts + 1, and every output
is checked against plain decoding (equal, or parting at a near tie of it: int8-activation kernels sum a multi-token
read in another order).
Speed: ``lmpress bench``'s protocol (plain and speculative decoding timed in turn, both compiled, adaptive draft
length), the W4 target with its own head, on a 64-token WikiText-2 test prompt and 128 new tokens.
Writes bench/results/draft_head.md and .json and the table into docs/results.md ("EAGLE-3 draft heads").
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lmpress, before an installed one
from quant_table import SMOLLM2, cpu_description  # noqa: E402
from readme_block import write_readme_block  # noqa: E402

import lmpress  # noqa: E402
from lmpress.data import calibration_samples, load_text, tokenize  # noqa: E402
from lmpress.distill.draft_head import capture_draft_data  # noqa: E402
from lmpress.distill.draft_head_stage import DraftHeadConfig, train_head_for  # noqa: E402
from lmpress.evals.agreement import INT8_ACTIVATION_UNIT  # noqa: E402
from lmpress.evals.speculation import check_near_tie, eval_prompts  # noqa: E402
from lmpress.loader import load_model  # noqa: E402
from lmpress.progress import Bars  # noqa: E402
from lmpress.runtime.eagle3 import Eagle3Config  # noqa: E402
from lmpress.runtime.generate import generate  # noqa: E402
from lmpress.runtime.model import Transformer  # noqa: E402
from lmpress.runtime.speculative import SpeculativeStats, speculative_decode  # noqa: E402
from lmpress.runtime.throughput import BenchSettings, bench_plain, bench_speculative  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CHAT = [
    "What is the capital of France, and what is it known for?",
    "Write a short poem about the sea.",
    "Explain how a bicycle works to a ten-year-old.",
    "Give me three tips for learning a new language.",
    "What are the main causes of the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a cup of tea?",
    "Why is the sky blue?",
    "What should I pack for a weekend hiking trip?",
    "Explain the difference between weather and climate.",
    "Write a friendly email inviting my team to a lunch on Friday.",
    "How does a vaccine help the body fight disease?",
    "What are some good habits for getting better sleep?",
    "Describe how plants make their food.",
    "Can you suggest a simple recipe for dinner tonight?",
    "What is the difference between a virus and a bacterium?",
    "Tell me a short story about a lost dog who finds its way home.",
    "How do airplanes stay in the air?",
    "What are the benefits of regular exercise?",
    "Explain what a computer program is in simple words.",
    "Why do leaves change color in the autumn?",
    "Give me some ideas for a birthday party for a seven-year-old.",
    "What is the water cycle?",
    "How can I save money on groceries?",
    "Who was Albert Einstein and what is he famous for?",
    "What are the planets in our solar system?",
    "Write a thank-you note to a teacher.",
    "How do I start learning to play the guitar?",
    "What causes earthquakes?",
    "Explain why we need to recycle.",
    "What is photosynthesis and why does it matter?",
    "How should I prepare for a job interview?",
]
W4_HEAD8 = dict(
    method="rtn",
    bits=4,
    group_size=64,
    symmetric=False,
    ignore=[],
    overrides={"lm_head": {"bits": 8, "group_size": -1}},
)


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        for text in CHAT[:count]
    ]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def acceptance(target: Transformer, head, prompts: list[list[int]], new_tokens: int) -> dict:
    stats = SpeculativeStats()
    identical = True  # or parting only at a near tie of plain decoding (eval.speculation's rule)
    unit = INT8_ACTIVATION_UNIT
    for prompt in prompts:
        drafted = list(
            speculative_decode(
                target, prompt, draft_head=head, max_new_tokens=new_tokens, k=3, adaptive=False, stats=stats
            )
        )
        plain = generate(target, prompt, max_new_tokens=new_tokens)[0]
        if drafted != plain:
            try:
                check_near_tie(target, prompt, plain, drafted, unit)
            except RuntimeError:
                identical = False
    return {"accept_length": stats.tokens_per_step, "acceptance_rate": stats.acceptance_rate, "identical": identical}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = DraftHeadConfig()
    parser.add_argument("--prompts", type=int, default=defaults.prompts)
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
    parser.add_argument("--new-tokens", type=int, default=defaults.new_tokens)
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--draft-vocab", type=int, default=defaults.draft_vocab)
    parser.add_argument("--eval-prompts", type=int, default=len(CHAT), help=f"per set, at most {len(CHAT)}")
    args = parser.parse_args()
    if not 1 <= args.eval_prompts <= len(CHAT):
        parser.error(f"--eval-prompts: 1 to {len(CHAT)}")
    config = DraftHeadConfig(
        prompts=args.prompts,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        epochs=args.epochs,
        draft_vocab=args.draft_vocab,
    )
    bars = Bars()
    loaded = load_model(SMOLLM2, "float32", fingerprint=False)
    models = {"float": loaded.model, "w4": copy.deepcopy(loaded.model)}
    lmpress.quantize_model(models["w4"], **W4_HEAD8)
    targets = {name: Transformer.from_hf(model) for name, model in models.items()}
    valid = tokenize(loaded.tokenizer, load_text("builtin:wikitext2:valid"))
    prompts = calibration_samples(valid, config.prompts, config.prompt_tokens, 0)
    heads, training = {}, {}
    with bars:
        for name, target in targets.items():
            began = time.perf_counter()
            head_config = Eagle3Config.for_target(target, models[name].config, config.draft_vocab)
            data = capture_draft_data(target, prompts, config.new_tokens, head_config.feature_layers, bars=bars)
            captured = time.perf_counter()
            heads[name], summary = train_head_for(target, models[name], data, config, head_config, bars)
            training[name] = {**summary, "capture_s": captured - began, "train_s": time.perf_counter() - captured}
    test = tokenize(loaded.tokenizer, load_text("builtin:wikitext2:test"))
    sets = {
        "wikitext2 test": eval_prompts(test, args.eval_prompts, 64),
        "chat": chat_prompts(loaded.tokenizer, args.eval_prompts),
    }
    rows = []
    for target_name, head_name in (("w4", "w4"), ("w4", "float"), ("float", "float")):
        for set_name, set_prompts in sets.items():
            score = acceptance(targets[target_name], heads[head_name], set_prompts, 64)
            rows.append({"target": target_name, "head trained for": head_name, "prompts": set_name, **score})
            print(rows[-1], flush=True)
    settings = BenchSettings(new_tokens=128, repeats=3, compile=True)
    plain = bench_plain(targets["w4"], sets["wikitext2 test"][0], settings, 0.0)
    speed = bench_speculative(targets["w4"], sets["wikitext2 test"][0], settings, plain, draft_head=heads["w4"])
    result = {
        "host": cpu_description(),
        "threads": torch.get_num_threads(),
        "config": config.model_dump(),
        "eval_prompts": args.eval_prompts,
        "training": training,
        "acceptance": rows,
        "speed": speed,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "draft_head.json").write_text(json.dumps(result, indent=2) + "\n")
    table = render(result)
    (RESULTS / "draft_head.md").write_text(table)
    write_readme_block("draft-head", "EAGLE-3 draft heads", table)
    print(table)


def render(result: dict) -> str:
    lines = [
        f"SmolLM2-135M, {result['host']}, {result['threads']} threads; `python bench/draft_head.py` "
        f"({result['config']['prompts']} prompts x {result['config']['new_tokens']} new tokens, "
        f"{result['config']['epochs']} epochs, draft vocabulary {result['config']['draft_vocab']}; "
        f"{result.get('eval_prompts', 8)} prompts per set, 64 new tokens each).",
        "",
        "| target | head trained for | prompts | tokens per target pass (k = 3) | acceptance | output as plain |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["acceptance"]:
        lines.append(
            f"| {row['target']} | {row['head trained for']} | {row['prompts']} | {row['accept_length']:.2f} | "
            f"{row['acceptance_rate']:.2f} | {'yes' if row['identical'] else 'NO'} |"
        )
    speed = result["speed"]
    lines += [
        "",
        f"W4 target with its head, compiled, adaptive k: {speed['decode_tok_s']:.1f} tok/s against plain "
        f"{speed['plain_decode_tok_s']:.1f} tok/s (**{speed['speedup']:.2f}x**), {speed['tokens_per_target_step']:.2f} "
        f"tokens per target pass, same tokens as plain: {'yes' if speed['identical_to_plain'] else 'NO'}.",
        "",
        "| head | capture s | train s | held-out step accuracy |",
        "| --- | --- | --- | --- |",
    ]
    for name, t in result["training"].items():
        accuracy = ", ".join(f"{a:.2f}" for a in t["held_out_step_accuracy"])
        lines.append(f"| {name} | {t['capture_s']:.0f} | {t['train_s']:.0f} | {accuracy} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
