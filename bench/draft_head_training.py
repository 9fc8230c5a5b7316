"""Draft-head training settings compared on one capture (issue 53): each variant of the ``draft_head`` stage's
training trained on the same continuations of SmolLM2-135M's W4 target and scored on the same held-out ones.

    python bench/draft_head_training.py                                  # the stage's defaults
    python bench/draft_head_training.py --variants '[{"batch_size": 8, "train_lm_head": true}, {"lr": 0.003}]'

Protocol. The target is ``bench/draft_head.py``'s W4 g64 (head W8) SmolLM2, run by lmpress's runtime on this
machine's threads; it continues ``--prompts`` WikiText-2 valid windows of 64 tokens by 192 (the stage's
capture, cached in ~/.cache/lmpress/bench/ so every variant and every later run learns from the same tokens).
Each variant is a set of ``draft_head`` stage keys over the stage's defaults (``train_head_for``: the head
seeded alike, 16 continuations held out); a row gives each drafting step's held-out accuracy, the tokens per
target pass they imply for rounds of 3 drafts, each epoch's mean training loss and the training time. Rows are
appended to bench/results/draft_head_training.jsonl; bench/results/draft_head_training.md is rendered from all.
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
from draft_head import W4_HEAD8  # noqa: E402
from quant_table import SMOLLM2, cpu_description  # noqa: E402

import lmpress  # noqa: E402
from lmpress.data import calibration_samples, load_text, tokenize  # noqa: E402
from lmpress.distill.draft_head import DraftData, capture_draft_data, text_draft_data  # noqa: E402
from lmpress.distill.draft_head_stage import DraftHeadConfig, train_head_for  # noqa: E402
from lmpress.loader import load_model  # noqa: E402
from lmpress.progress import Bars  # noqa: E402
from lmpress.runtime.eagle3 import Eagle3Config  # noqa: E402
from lmpress.runtime.model import Transformer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path.home() / ".cache" / "lmpress" / "bench"
HELD_OUT = 16
TOP = 32  # the target's likeliest tokens each capture keeps: variants may learn them (soft_labels <= TOP)


def continuations_file(prompts: int) -> Path:
    return CACHE / f"draft-data-w4-{prompts}x64+192-top{TOP}.pt"  # the target's top tokens kept too


def captured(target: Transformer, tokenizer, prompts: int, layers: tuple[int, ...], bars: Bars) -> DraftData:
    path = continuations_file(prompts)
    if path.is_file():
        return DraftData(**torch.load(path, weights_only=True))
    valid = tokenize(tokenizer, load_text("builtin:wikitext2:valid"))
    starts = calibration_samples(valid, prompts, 64, 0)
    data = capture_draft_data(target, starts, 192, layers, bars=bars, soft_labels=TOP)
    CACHE.mkdir(parents=True, exist_ok=True)
    torch.save(vars(data), path)
    return data


def text_captured(target: Transformer, tokenizer, sequences: int, layers: tuple[int, ...], bars: Bars) -> DraftData:
    """``sequences`` windows of 256 WikiText-2 *test* tokens with the target's features and choices, teacher-forced
    (test, not valid: the held-out continuations start from valid windows)."""
    path = CACHE / f"draft-text-w4-{sequences}x256-top{TOP}.pt"
    if path.is_file():
        return DraftData(**torch.load(path, weights_only=True))
    test = tokenize(tokenizer, load_text("builtin:wikitext2:test"))
    data = text_draft_data(target, calibration_samples(test, sequences, 256, 0), layers, bars, TOP)
    CACHE.mkdir(parents=True, exist_ok=True)
    torch.save(vars(data), path)
    return data


def held_out_continuations(target: Transformer, tokenizer, prompts: int, layers: tuple[int, ...], bars: Bars):
    """The held-out rows of the ``prompts`` capture (its last 16 continuations): from its cached file, else those 16
    generated alone."""
    path = continuations_file(prompts)
    if path.is_file():
        return DraftData(**torch.load(path, weights_only=True)).split(HELD_OUT)[1]
    valid = tokenize(tokenizer, load_text("builtin:wikitext2:valid"))
    return capture_draft_data(target, calibration_samples(valid, prompts, 64, 0)[-HELD_OUT:], 192, layers, bars=bars)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--variants", default="[{}]", help="a JSON list of draft_head stage keys, one per row")
    parser.add_argument(
        "--capture",
        choices=("continuations", "text"),
        default="continuations",
        help="learn from the target's continuations of --prompts prompts (the stage's capture), or from --prompts "
        "windows of 256 WikiText-2 test tokens read teacher-forced; scored on the same held-out continuations",
    )
    args = parser.parse_args()
    variants = json.loads(args.variants)
    loaded = load_model(SMOLLM2, "float32", fingerprint=False)
    model = copy.deepcopy(loaded.model)
    lmpress.quantize_model(model, **W4_HEAD8)
    target = Transformer.from_hf(model)
    layout = Eagle3Config.for_target(target, model.config, DraftHeadConfig().draft_vocab)
    RESULTS.mkdir(exist_ok=True)
    with Bars() as bars:
        held_out = None
        if args.capture == "text":
            data = text_captured(target, loaded.tokenizer, args.prompts, layout.feature_layers, bars)
            held_out = held_out_continuations(target, loaded.tokenizer, args.prompts, layout.feature_layers, bars)
        else:
            data = captured(target, loaded.tokenizer, args.prompts, layout.feature_layers, bars)
        for variant in variants:
            config = DraftHeadConfig(prompts=args.prompts, held_out=HELD_OUT, **variant)
            head_config = Eagle3Config.for_target(target, model.config, config.draft_vocab)
            began = time.perf_counter()
            _, summary = train_head_for(target, model, data, config, head_config, bars, held_out)
            row = {
                "host": cpu_description(),
                "threads": torch.get_num_threads(),
                "date": time.strftime("%Y-%m-%d"),
                "prompts": args.prompts,
                "variant": variant,
                "capture": args.capture,
                "soft_labels": config.soft_labels,  # 0 (rows before it was recorded too): the target's choice only
                "train_s": round(time.perf_counter() - began),
                "held_out_step_accuracy": [round(a, 3) for a in summary["held_out_step_accuracy"]],
                "expected_accept_length": round(summary["held_out_expected_accept_length"], 3),
                "accept_length": round(summary["held_out_accept_length"], 3),  # as decoding's rounds get it
                "epoch_losses": [round(x, 3) for x in summary["epoch_losses"]],
            }
            with (RESULTS / "draft_head_training.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    rows = [json.loads(line) for line in (RESULTS / "draft_head_training.jsonl").read_text().splitlines()]
    (RESULTS / "draft_head_training.md").write_text(render(rows))


def render(rows: list[dict]) -> str:
    defaults = DraftHeadConfig()
    lines = [
        "Draft-head training variants on one capture (`python bench/draft_head_training.py --variants ...`):",
        f"SmolLM2-135M W4 g64 (head W8) target, `--prompts` continuations ({HELD_OUT} held out: another 16 for each",
        "count of prompts, each drawn from WikiText-2's valid split by the same seed); each variant's",
        f"keys over the stage's defaults (today batch_size {defaults.batch_size}, lr {defaults.lr}, epochs "
        f"{defaults.epochs}, train_lm_head {str(defaults.train_lm_head).lower()}).",
        "",
        "| date | host | prompts | variant | labels | held-out step accuracy | tokens per pass (3 drafts), "
        "from the accuracies | as decoding's rounds give them | epoch losses | train s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    notes = sorted({r["note"] for r in rows if r.get("note")})
    for r in rows:
        variant = ", ".join(f"{k}: {json.dumps(v)}" for k, v in r["variant"].items()) or "defaults"
        if r.get("capture") == "text":
            variant = f"**text** (teacher-forced), {variant}"
        if r.get("note"):
            variant += " " + "*" * (notes.index(r["note"]) + 1)
        labels = f"target's top {r['soft_labels']}" if r.get("soft_labels") else "target's choice"
        accuracy = " / ".join(f"{a:.3f}" for a in r["held_out_step_accuracy"])
        losses = " / ".join(f"{x:.2f}" for x in r["epoch_losses"])
        rounds = f"{r['accept_length']:.3f}" if "accept_length" in r else "not recorded"
        lines.append(
            f"| {r['date']} | {r['host']}, {r['threads']} threads | {r.get('prompts', 256)} | {variant} | {labels} | "
            f"{accuracy} | "
            f"{r['expected_accept_length']:.3f} | {rounds} | {losses} | {r['train_s']} |"
        )
    lines += [f"\n{'*' * (i + 1)} {note}." for i, note in enumerate(notes)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
