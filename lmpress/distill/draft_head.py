"""Training an EAGLE-3 draft head for the compressed target (``lmpress.runtime.eagle3``), by self-distillation.

Data: the target, as lmpress's runtime runs it, continues calibration prompts greedily; its features (the
residual stream entering the head's layers) and its own next-token choices at every position are captured once
(``capture_draft_data``; a run keeps them on disk). The head learns the target's choices, not the text's.

Training-time test (Li et al. 2025, Section 3.2): a head drafts ``k`` tokens in a row at inference, each step
reading its own previous output vector instead of the target's, so it is trained that way. Step ``j`` at
position ``t`` reads token ``t + 1``'s embedding and the head's step ``j - 1`` output at ``t - 1`` and predicts
the target's token after ``t + 1``; it attends to the step-0 entries of positions up to ``t - j`` (those the
target's features gave) and to one entry of each step ``1..j`` along its own chain (``training_time_attention``):
what the drafter's cache holds when it drafts there.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from lmpress.errors import LmpressInputError
from lmpress.progress import QUIET, Bars
from lmpress.runtime.eagle3 import Eagle3Head
from lmpress.runtime.generate import generate_tokens
from lmpress.runtime.model import Transformer
from lmpress.runtime.sample import SamplingConfig
from lmpress.runtime.speculative import frequent_tokens

IGNORE = -100  # a position whose target choice the draft vocabulary cannot give: no loss there


@dataclass
class DraftData:
    """What the head learns from: ``tokens`` ``(N, n)``, the target's ``features`` ``(N, n, width)`` (bfloat16)
    and its greedy choice ``choices`` ``(N, n)`` after each position."""

    tokens: torch.Tensor
    features: torch.Tensor
    choices: torch.Tensor

    def split(self, held_out: int) -> tuple[DraftData, DraftData]:
        """The first rows to train on, the last ``held_out`` to score on."""
        if not 0 < held_out < len(self.tokens):
            raise LmpressInputError(f"{len(self.tokens)} sequences cannot spare {held_out} for scoring the head")
        cut = len(self.tokens) - held_out
        parts = [(t[:cut], t[cut:]) for t in (self.tokens, self.features, self.choices)]
        return DraftData(*(p[0] for p in parts)), DraftData(*(p[1] for p in parts))


FEATURE_ROWS = 4  # sequences per features forward: its logits (rows x length x vocab, float32) are its peak


@torch.no_grad()
def capture_draft_data(
    target: Transformer,
    prompts: torch.Tensor,
    new_tokens: int,
    feature_layers: tuple[int, ...],
    batch_size: int = 16,
    bars: Bars = QUIET,
) -> DraftData:
    """The target's greedy continuations of ``prompts`` ``(N, p)`` by ``new_tokens`` tokens, with its features and
    choices at every position of prompt and continuation."""
    if new_tokens < 1:
        raise LmpressInputError(f"a draft head learns from the target's continuations: new_tokens {new_tokens} < 1")
    tokens = torch.empty(len(prompts), prompts.shape[1] + new_tokens, dtype=torch.long)
    for start in bars.track(range(0, len(prompts), batch_size), "draft head: target continues", None):
        batch = prompts[start : start + batch_size]
        steps = generate_tokens(target, batch, new_tokens, SamplingConfig(temperature=0.0))
        tokens[start : start + len(batch)] = torch.cat((batch, torch.stack([step.cpu() for step in steps], 1)), 1)
    return text_draft_data(target, tokens, feature_layers, bars)


@torch.no_grad()
def text_draft_data(
    target: Transformer, tokens: torch.Tensor, feature_layers: tuple[int, ...], bars: Bars = QUIET
) -> DraftData:
    """The target's features and greedy choices at every position of ``tokens`` ``(N, n)``, read in one forward
    pass each (teacher-forced: the text, not the target's own continuation of it)."""
    length = tokens.shape[1]
    choices = torch.empty(len(tokens), length, dtype=torch.long)
    features = torch.empty(len(tokens), length, len(feature_layers) * target.args.dim, dtype=torch.bfloat16)
    for row in bars.track(range(0, len(tokens), FEATURE_ROWS), "draft head: target features", None):
        text = tokens[row : row + FEATURE_ROWS]
        logits, seen = target.forward_with_features(text, target.new_cache(len(text), length), feature_layers)
        features[row : row + len(text)] = seen.to(torch.bfloat16).cpu()
        choices[row : row + len(text)] = logits.argmax(-1).cpu()
    return DraftData(tokens, features, choices)


def draft_vocabulary(choices: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` tokens the target chooses most often (FR-Spec's frequency rule, as EAGLE-3's ``d2t``)."""
    return frequent_tokens(choices, size, vocab_size)


def draft_rows(choices: torch.Tensor, draft_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each target choice as its row of the draft vocabulary (``IGNORE`` outside it)."""
    row_of = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    row_of[draft_tokens] = torch.arange(len(draft_tokens))
    return row_of[choices]


def training_time_attention(
    head: Eagle3Head, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
) -> torch.Tensor:
    """Step ``j = len(keys) - 1``'s attention ``(batch, heads, n, head_dim)``: query ``t`` over step 0's keys at
    positions ``<= t - j`` and over step ``i``'s key at ``t - j + i`` for ``i = 1..j`` (its own chain)."""
    j, n = len(keys) - 1, q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    k0, v0 = head.repeat_kv(keys[0]), head.repeat_kv(values[0])
    scores = q @ k0.transpose(-1, -2) * scale
    pos = torch.arange(n, device=q.device)
    scores = scores.masked_fill(pos[None, :] > pos[:, None] - j, float("-inf"))
    chain_v = []
    extra = []
    for i in range(1, j + 1):  # step i's entry at t - j + i: its tensor shifted right by j - i positions
        k_i, v_i = (F.pad(head.repeat_kv(x), (0, 0, j - i, 0))[:, :, :n] for x in (keys[i], values[i]))
        extra.append((q * k_i).sum(-1, keepdim=True) * scale)
        chain_v.append(v_i)
    weights = torch.cat((scores, *extra), -1).softmax(-1)
    out = weights[..., :n] @ v0
    for i, v_i in enumerate(chain_v):
        out = out + weights[..., n + i : n + i + 1] * v_i
    return out


def training_time_outputs(
    head: Eagle3Head, embeds: torch.Tensor, features: torch.Tensor, steps: int
) -> Iterator[torch.Tensor]:
    """The layer's outputs ``(batch, n, hidden)`` at each of ``steps`` drafting steps: ``embeds`` ``(batch, n,
    hidden)`` of token ``t + 1`` and the target's ``features`` at ``t``. Step ``j``'s output at ``t`` is what the
    drafter computes for its ``j``-th draft after position ``t - j`` (earlier positions: padding)."""
    positions = torch.arange(embeds.shape[1], device=embeds.device)
    hidden = head.fc(features)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for _ in range(steps):
        q, k, v, residual = head.qkv(embeds, hidden, positions)
        keys.append(k)
        values.append(v)
        out = head.finish(training_time_attention(head, q, keys, values), residual)
        yield out
        hidden = F.pad(out[:, :-1], (0, 0, 1, 0))  # position t reads the output at t - 1


def training_time_test(
    head: Eagle3Head, embeds: torch.Tensor, features: torch.Tensor, rows: torch.Tensor, steps: int
) -> tuple[torch.Tensor, list[float]]:
    """The mean loss over ``steps`` drafting steps and each step's accuracy (``training_time_outputs``); ``rows``:
    the draft row of the target's choice after token ``t + 1`` (``IGNORE``: none)."""
    losses, accuracies = [], []
    for j, out in enumerate(training_time_outputs(head, embeds, features, steps)):
        logits, want = head.logits(out[:, j:]), rows[:, j:]  # a chain of j steps starts at a position >= 0
        losses.append(F.cross_entropy(logits.flatten(0, 1), want.flatten(), ignore_index=IGNORE))
        scored = want != IGNORE
        accuracies.append(float((logits.argmax(-1) == want)[scored].float().mean()) if scored.any() else 0.0)
    return torch.stack(losses).mean(), accuracies


def batches(data: DraftData, target: Transformer, head: Eagle3Head, batch_size: int, shuffle: torch.Generator | None):
    """``training_time_test``'s inputs, ``batch_size`` sequences at a time (in a random order with ``shuffle``)."""
    order = (
        torch.randperm(len(data.tokens), generator=shuffle) if shuffle is not None else torch.arange(len(data.tokens))
    )
    vocab = head.config.vocab_size
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        tokens = data.tokens[index]
        with torch.no_grad():
            embeds = target.tok_embeddings(tokens[:, 1:].to(target.device)).float().cpu()
        rows = draft_rows(data.choices[index][:, 1:], head.draft_tokens, vocab)
        yield embeds, data.features[index][:, :-1].float(), rows


@dataclass
class DraftHeadTraining:
    epochs: int = 2
    steps: int = 3  # drafting steps trained (training-time test)
    lr: float = 1e-3
    batch_size: int = 4
    seed: int = 0


def train_draft_head(
    head: Eagle3Head,
    target: Transformer,
    data: DraftData,
    config: DraftHeadTraining,
    bars: Bars = QUIET,
) -> list[float]:
    """Train ``head`` on ``data`` (AdamW, cosine decay); each epoch's mean loss."""
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    total = config.epochs * math.ceil(len(data.tokens) / config.batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 0.5 * (1 + math.cos(math.pi * i / total)))
    shuffle = torch.Generator().manual_seed(config.seed)
    head.train()
    epoch_losses = []
    for epoch in range(config.epochs):
        seen = []
        for embeds, features, rows in bars.track(
            batches(data, target, head, config.batch_size, shuffle),
            f"draft head: epoch {epoch + 1}/{config.epochs}",
            math.ceil(len(data.tokens) / config.batch_size),
        ):
            loss, _ = training_time_test(head, embeds, features, rows, config.steps)
            if not torch.isfinite(loss):
                raise LmpressInputError(
                    "draft head training: the loss became NaN or inf (the target's features hold non-finite values?)"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            seen.append(float(loss.detach()))
        epoch_losses.append(sum(seen) / len(seen))
    head.eval()
    return epoch_losses


@torch.no_grad()
def step_accuracies(head: Eagle3Head, target: Transformer, data: DraftData, steps: int) -> list[float]:
    """Each drafting step's accuracy on ``data`` (held out): how often step ``j`` gives the target's choice when
    the steps before it did."""
    sums, count = [0.0] * steps, 0
    for embeds, features, rows in batches(data, target, head, 8, None):
        _, accuracies = training_time_test(head, embeds, features, rows, steps)
        sums = [s + a * len(embeds) for s, a in zip(sums, accuracies, strict=True)]
        count += len(embeds)
    return [s / count for s in sums]


def initialize_from_target(head: Eagle3Head, hf_model: torch.nn.Module) -> bool:
    """The head's output rows and final norm from the target's: its draft tokens' rows of the output layer (as
    the target computes with it: a quantized head dequantized); the rest stays as initialized. Returns whether the
    rows were copied (not where the output layer is neither dense nor dequantizable, or another shape)."""
    output = hf_model.get_output_embeddings()
    if hasattr(output, "dequantized_weight"):  # QuantizedLinear, Fp8Linear, Fp4Linear
        weight = output.dequantized_weight(torch.float32)
    else:
        weight = getattr(output, "weight", None)
    with torch.no_grad():
        dense = isinstance(weight, torch.Tensor) and weight.is_floating_point()
        copied = dense and weight.shape == (head.config.vocab_size, head.config.hidden_size)
        if copied:
            head.lm_head.weight.copy_(weight[head.draft_tokens].float())
        norm = getattr(hf_model.model, "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None:
            head.norm.weight.copy_(norm.weight.float())
    return copied
