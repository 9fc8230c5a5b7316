"""Training an EAGLE-3 draft head for the compressed target (``lmpress.runtime.eagle3``), by self-distillation.

Data: the target, as lmpress's runtime runs it, continues calibration prompts greedily; its features (the
residual stream entering the head's layers) and its own next-token choice at every position (with
``soft_labels``, its likeliest next tokens and their probabilities too) are captured once, as it reads them
(``capture_draft_data``; a run keeps them on disk). The head learns the target's choices, not the text's (with
soft labels, its distribution over the draft vocabulary: EAGLE-3's loss).

Training-time test (Li et al. 2025, Section 3.2): a head drafts ``k`` tokens in a row at inference, each step
reading its own previous output vector instead of the target's, so it is trained that way. Step ``j`` at
position ``t`` reads token ``t + 1``'s embedding and the head's step ``j - 1`` output at ``t - 1`` and predicts
the target's token after ``t + 1``; it attends to the step-0 entries of positions up to ``t - j`` (those the
target's features gave) and to one entry of each step ``1..j`` along its own chain (``training_time_attention``):
what the drafter's cache holds when it drafts there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from lmpress.errors import LmpressInputError
from lmpress.progress import QUIET, Bars
from lmpress.runtime.eagle3 import Eagle3Head
from lmpress.runtime.model import Transformer
from lmpress.runtime.speculative import frequent_tokens

IGNORE = -100  # a position whose target choice the draft vocabulary cannot give: no loss there


@dataclass
class DraftData:
    """What the head learns from: ``tokens`` ``(N, n)``, the target's ``features`` ``(N, n, width)`` (bfloat16)
    and its greedy choice ``choices`` ``(N, n)`` after each position; where captured, the target's ``soft_labels``
    most likely next tokens ``top_tokens`` ``(N, n, K)`` and their probabilities ``top_probs`` (bfloat16)."""

    tokens: torch.Tensor
    features: torch.Tensor
    choices: torch.Tensor
    top_tokens: torch.Tensor | None = None
    top_probs: torch.Tensor | None = None

    def split(self, held_out: int) -> tuple[DraftData, DraftData]:
        """The first rows to train on, the last ``held_out`` to score on."""
        if not 0 < held_out < len(self.tokens):
            raise LmpressInputError(f"{len(self.tokens)} sequences cannot spare {held_out} for scoring the head")
        cut = len(self.tokens) - held_out
        parts = [
            (None, None) if t is None else (t[:cut], t[cut:])
            for t in (self.tokens, self.features, self.choices, self.top_tokens, self.top_probs)
        ]
        return DraftData(*(p[0] for p in parts)), DraftData(*(p[1] for p in parts))


LOGIT_ROWS = 256  # positions read per forward of a capture at most: their logits (x vocab, float32)
CAPTURE_BATCH = 16  # sequences the target continues at a time: their KV cache (SmolLM2, 256 tokens: 180 MiB)


@torch.no_grad()
def capture_draft_data(
    target: Transformer,
    prompts: torch.Tensor,
    new_tokens: int,
    feature_layers: tuple[int, ...],
    batch_size: int = CAPTURE_BATCH,
    bars: Bars = QUIET,
    soft_labels: int = 0,
) -> DraftData:
    """The target's greedy continuations of ``prompts`` ``(N, p)`` by ``new_tokens`` tokens, with its features,
    choices and ``soft_labels`` likeliest tokens at every position of prompt and continuation: read as the target
    writes them (its prefill, then each new token as it reads it), ``batch_size`` prompts at a time."""
    if new_tokens < 1:
        raise LmpressInputError(f"a draft head learns from the target's continuations: new_tokens {new_tokens} < 1")
    prompt_len, length = prompts.shape[1], prompts.shape[1] + new_tokens
    data = _empty_data(len(prompts), length, len(feature_layers) * target.args.dim, soft_labels)
    data.tokens[:, :prompt_len] = prompts
    for start in bars.track(range(0, len(prompts), batch_size), "draft head: target continues", None):
        rows = slice(start, start + batch_size)
        batch = prompts[rows]
        cache = target.new_cache(len(batch), length)
        while cache.length < length:  # the prompt (LOGIT_ROWS positions a read), then each token the target chose
            at = cache.length
            if at < prompt_len:
                read = batch[:, at : at + max(1, LOGIT_ROWS // len(batch))]
            else:
                read = data.choices[rows, at - 1 : at]
                data.tokens[rows, at] = read[:, 0]
            logits, seen = target.forward_with_features(read, cache, feature_layers)
            _keep(data, rows, slice(at, cache.length), logits, seen, soft_labels)
        del cache  # before the next batch's is made: never two held at once
    return data


@torch.no_grad()
def text_draft_data(
    target: Transformer,
    tokens: torch.Tensor,
    feature_layers: tuple[int, ...],
    bars: Bars = QUIET,
    soft_labels: int = 0,
) -> DraftData:
    """The target's features, greedy choices and ``soft_labels`` likeliest tokens (none: 0) at every position of
    ``tokens`` ``(N, n)``, read in one forward pass each (teacher-forced: the text, not the target's own
    continuation of it)."""
    length = tokens.shape[1]
    data = _empty_data(len(tokens), length, len(feature_layers) * target.args.dim, soft_labels)
    data.tokens.copy_(tokens)
    per_read = max(1, LOGIT_ROWS // length)
    for row in bars.track(range(0, len(tokens), per_read), "draft head: target features", None):
        text = tokens[row : row + per_read]
        logits, seen = target.forward_with_features(text, target.new_cache(len(text), length), feature_layers)
        _keep(data, slice(row, row + len(text)), slice(0, length), logits, seen, soft_labels)
    return data


def _empty_data(sequences: int, length: int, width: int, soft_labels: int) -> DraftData:
    shape = (sequences, length)
    return DraftData(
        torch.empty(shape, dtype=torch.long),
        torch.empty(*shape, width, dtype=torch.bfloat16),
        torch.empty(shape, dtype=torch.long),
        torch.empty(*shape, soft_labels, dtype=torch.int32) if soft_labels else None,
        torch.empty(*shape, soft_labels, dtype=torch.bfloat16) if soft_labels else None,
    )


def _keep(
    data: DraftData, rows: slice, positions: slice, logits: torch.Tensor, features: torch.Tensor, soft_labels: int
) -> None:
    """The target's features, choices and likeliest tokens where it read ``rows`` at ``positions``."""
    data.features[rows, positions] = features.to(torch.bfloat16).cpu()
    data.choices[rows, positions] = logits.argmax(-1).cpu()
    for row, scores in enumerate(logits.float() if soft_labels else ()):  # a sequence at a time: its logsumexp
        top = scores.topk(soft_labels, -1)
        probs = (top.values - scores.logsumexp(-1, keepdim=True)).exp()
        data.top_tokens[rows.start + row, positions] = top.indices.cpu().to(torch.int32)
        data.top_probs[rows.start + row, positions] = probs.cpu().to(torch.bfloat16)


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


SoftLabels = tuple[torch.Tensor, torch.Tensor]  # draft rows (IGNORE: outside) and probabilities, (batch, n, K)


def training_time_test(
    head: Eagle3Head,
    embeds: torch.Tensor,
    features: torch.Tensor,
    rows: torch.Tensor,
    steps: int,
    soft: SoftLabels | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """The mean loss over ``steps`` drafting steps and each step's accuracy (``training_time_outputs``); ``rows``:
    the draft row of the target's choice after token ``t + 1`` (``IGNORE``: none). The loss is the cross-entropy
    against that choice, or with ``soft`` against the target's distribution over the draft vocabulary (its top
    tokens there, renormalized: EAGLE-3's loss), at the positions whose choice the draft vocabulary holds."""
    losses, accuracies = [], []
    for j, out in enumerate(training_time_outputs(head, embeds, features, steps)):
        logits, want = head.logits(out[:, j:]), rows[:, j:]  # a chain of j steps starts at a position >= 0
        scored = want != IGNORE
        if soft is None:
            losses.append(F.cross_entropy(logits.flatten(0, 1), want.flatten(), ignore_index=IGNORE))
        else:
            losses.append(soft_cross_entropy(logits, soft[0][:, j:], soft[1][:, j:], scored))
        accuracies.append(float((logits.argmax(-1) == want)[scored].float().mean()) if scored.any() else 0.0)
    return torch.stack(losses).mean(), accuracies


def soft_cross_entropy(
    logits: torch.Tensor, top_rows: torch.Tensor, top_probs: torch.Tensor, scored: torch.Tensor
) -> torch.Tensor:
    """``-sum p log q`` over the draft rows ``top_rows`` ``(..., K)`` the target gives probabilities ``top_probs``
    (renormalized over those the draft vocabulary holds), averaged over the ``scored`` positions."""
    kept = torch.where(top_rows != IGNORE, top_probs, 0.0)
    p = kept / kept.sum(-1, keepdim=True).clamp_min(1e-12)
    logq = logits.log_softmax(-1).gather(-1, top_rows.clamp_min(0))
    per_position = -(p * logq).sum(-1)
    return per_position[scored].mean() if scored.any() else logits.sum() * 0.0


def batches(
    data: DraftData,
    target: Transformer,
    head: Eagle3Head,
    batch_size: int,
    shuffle: torch.Generator | None,
    soft_labels: int = 0,
):
    """``training_time_test``'s inputs, ``batch_size`` sequences at a time (in a random order with ``shuffle``);
    the target's top ``soft_labels`` tokens where ``data`` has them, else None."""
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
        soft = None
        if soft_labels and data.top_tokens is not None:
            top = data.top_tokens[index][:, 1:, :soft_labels].long()
            soft = (draft_rows(top, head.draft_tokens, vocab), data.top_probs[index][:, 1:, :soft_labels].float())
        yield embeds, data.features[index][:, :-1].float(), rows, soft


@dataclass
class DraftHeadTraining:
    epochs: int = 2
    steps: int = 3  # drafting steps trained (training-time test)
    lr: float = 1e-3
    batch_size: int = 4
    seed: int = 0
    soft_labels: int = 0  # learn the target's distribution over its top tokens (0: its choice only)


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
        for embeds, features, rows, soft in bars.track(
            batches(data, target, head, config.batch_size, shuffle, config.soft_labels),
            f"draft head: epoch {epoch + 1}/{config.epochs}",
            math.ceil(len(data.tokens) / config.batch_size),
        ):
            loss, _ = training_time_test(head, embeds, features, rows, config.steps, soft)
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


def _batch_hits(
    head: Eagle3Head, embeds: torch.Tensor, features: torch.Tensor, rows: torch.Tensor, steps: int, top: Sequence[int]
) -> list[torch.Tensor]:
    hits = []
    for j, out in enumerate(training_time_outputs(head, embeds, features, steps)):
        ranked = head.logits(out).topk(top[j] if top else 1, -1).indices
        hits.append((ranked == rows[..., None]).any(-1))
    return hits


@torch.no_grad()
def draft_hits(
    head: Eagle3Head, target: Transformer, data: DraftData, steps: int, top: Sequence[int] = ()
) -> Iterator[list[torch.Tensor]]:
    """Per batch of ``data``, for each drafting step ``j``, whether the target's token after each position is among
    the head's ``top[j]`` likeliest (default 1: its draft) ``(batch, n)``, every earlier step's having been the
    target's (the training-time test's chain reads the target's own tokens)."""
    for embeds, features, rows, _ in batches(data, target, head, 8, None):
        yield _batch_hits(head, embeds, features, rows, steps, top)


@torch.no_grad()
def held_out_scores(
    head: Eagle3Head, target: Transformer, data: DraftData, steps: int, first: int
) -> tuple[list[float], float]:
    """From one pass of the head over ``data`` (held out): each drafting step's accuracy (how often step ``j`` gives
    the target's choice when the steps before it did; batches weighted by their sequences) and the tokens per pass
    decoding gets (``decoding_accept_length`` of its drafts, rounds from ``first``)."""
    sums, count, per_batch = [0.0] * steps, 0, []
    for embeds, features, rows, _ in batches(data, target, head, 8, None):
        hits = _batch_hits(head, embeds, features, rows, steps, ())
        for j, hit in enumerate(hits):  # a chain of j steps starts at a position >= 0
            scored = rows[:, j:] != IGNORE
            if scored.any():
                sums[j] += float(hit[:, j:][scored].float().mean()) * len(embeds)
        count += len(embeds)
        per_batch.append(hits)
    return [s / count for s in sums], decoding_accept_length(per_batch, first)


def decoding_accept_length(batches_of_hits: Iterable[list[torch.Tensor]], first: int) -> float:
    """Tokens per target pass as decoding gets them from ``draft_hits``: a round drafting at position ``s``
    accepts step ``j``'s draft (at ``s + j``) while every step so far hit, gives the target's token besides, and the
    next round drafts after them. Rounds start at ``first`` (the prompt's last position), then wherever the last
    one left off: after a rejection more often than an average position is, which is why this is lower than the
    steps' accuracies averaged over every position suggest (SmolLM2 W4, 16 held-out continuations: 1.59, what
    speculative decoding measured on them, against 1.89 over every position)."""
    tokens = passes = 0
    for hits in batches_of_hits:
        steps, n = len(hits), hits[0].shape[1]
        for row in zip(*(h.tolist() for h in hits), strict=True):
            s = first
            while s + steps <= n:
                accepted = 0
                while accepted < steps and row[accepted][s + accepted]:
                    accepted += 1
                tokens, passes = tokens + 1 + accepted, passes + 1
                s += 1 + accepted
    return tokens / passes if passes else 1.0


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
