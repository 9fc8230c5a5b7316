"""Training windows the teacher writes: chat prompts that quote the training text, answered by the teacher.

A speculative draft is judged on the target's own outputs, in the target's chat format; a
draft trained only on plain text has never seen either. DistillSpec (Zhou et al. 2023, §3-4)
trains the draft on model-generated text and reports higher acceptance than training on a
fixed dataset. Here each prompt is one instruction (drawn in turn from ``instructions``) and
a passage of ``quote_tokens`` tokens of the training text, in the tokenizer's chat template;
the teacher answers greedily until the window holds ``seq_len`` tokens (its end-of-turn token
is held back until then, so every window is full). The windows join the text's windows in
training, and the logit loss is the same on both. They are written to the stage's state
directory, so ``--resume`` reuses them. For SmolLM2's draft (recipes/draft-student.yaml), 512 answers
to prompts quoting the Python docs made a better language model (wiki.test ppl 186 -> 175) but did not
raise its acceptance on the runtime benchmark's code-rewrite prompt (0.34 with and without); trained on
code and 768 answers to prompts quoting code, its greedy agreement with the full model on that prompt's
answer rose from 0.62 to 0.74 (bench/draft_probe.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.progress import QUIET, Bars
from lmpress.registry import StrictConfig

DEFAULT_INSTRUCTIONS = (
    "Summarize the following text.",
    "Explain what the following text says, step by step.",
    "Rewrite the following text so that it is easier to read.",
    "Continue the following text.",
    "Answer a question a reader might ask about the following text.",
)
PLACEHOLDER = "\x00QUOTE\x00"


class TeacherAnswers(StrictConfig):
    prompts: int = Field(64, ge=1, description="prompts the teacher answers")
    quote_tokens: int = Field(128, ge=8, description="tokens of training text each prompt quotes")
    instructions: list[str] = Field(default_factory=lambda: list(DEFAULT_INSTRUCTIONS), min_length=1)
    batch_size: int = Field(8, ge=1, description="prompts answered at once")


def chat_prompt_ids(tokenizer: Any, instruction: str, quote: list[int]) -> list[int]:
    """The chat-templated user turn (instruction, blank line, quote) ready for the assistant's answer.

    The quote goes in as token ids, not re-tokenized text, so it is exactly the training text's tokens.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise LmpressInputError("stage distill: teacher_answers needs a tokenizer with a chat template")
    messages = [{"role": "user", "content": f"{instruction}\n\n{PLACEHOLDER}"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    before, after = text.split(PLACEHOLDER)
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return encode(before) + list(quote) + encode(after)


def draw_quotes(ids: torch.Tensor, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` passages of ``length`` tokens at seeded offsets in the 1-D stream ``ids``."""
    if ids.numel() < length:
        raise LmpressInputError(f"stage distill: teacher_answers quotes {length} tokens; the text has {ids.numel()}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - length + 1, (n,), generator=generator)
    return [ids[s : s + length].tolist() for s in starts.tolist()]


@torch.no_grad()
def teacher_answer_windows(
    teacher: nn.Module,
    tokenizer: Any,
    ids: torch.Tensor,
    config: TeacherAnswers,
    seq_len: int,
    seed: int,
    state_dir: Path,
    device: torch.device,
    bars: Bars = QUIET,
) -> torch.Tensor:
    """``(config.prompts, seq_len)`` windows: a prompt and the teacher's greedy answer (cached in ``state_dir``)."""
    quotes = draw_quotes(ids, config.prompts, config.quote_tokens, seed)
    instructions = config.instructions
    prompts = [chat_prompt_ids(tokenizer, instructions[i % len(instructions)], q) for i, q in enumerate(quotes)]
    longest = max(len(p) for p in prompts)
    if longest >= seq_len:
        raise LmpressInputError(
            f"stage distill: a teacher_answers prompt takes {longest} tokens, seq_len is {seq_len}: "
            "lower quote_tokens or raise seq_len"
        )
    key = hashlib.sha256(json.dumps([prompts, seq_len]).encode()).hexdigest()
    path = state_dir / f"teacher_answers_{key[:16]}.pt"
    if path.exists():
        return torch.load(path)
    windows = torch.empty(len(prompts), seq_len, dtype=torch.long)
    # prompts of one length share a batch, so no padding enters the teacher
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    size = config.batch_size
    batches = [rows[j : j + size] for rows in by_length.values() for j in range(0, len(rows), size)]
    for rows in bars.track(batches, "teacher answers"):
        prompt = torch.tensor([prompts[i] for i in rows], device=device)
        new = seq_len - prompt.shape[1]
        out = teacher.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id or 0,  # no padding happens; this silences generate's warning
        )
        windows[rows] = out[:, :seq_len].cpu()
    state_dir.mkdir(parents=True, exist_ok=True)
    torch.save(windows, path)
    return windows
