"""Speculative decoding: a drafter proposes k tokens, the target checks them all in one forward.

Drafters: a smaller (or lower-bit) model with the target's vocabulary (``ModelDrafter``),
or n-gram matches in the text so far (``PromptLookupDrafter``, no model). Acceptance
follows Leviathan et al. 2023 (Algorithm 1), so accepted tokens are distributed as
the target's own samples; greedy decoding is the special case of one-hot
distributions, and then the output equals plain greedy decoding token for token.
Batch 1 only: rows of a batch accept different numbers of tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmpress.errors import LmpressInputError
from lmpress.memory import trims_heap_after
from lmpress.runtime.attention import FEW_QUERIES
from lmpress.runtime.eagle3 import Eagle3Drafter, Eagle3Head, HeadStep
from lmpress.runtime.generate import (
    ForwardFn,
    StopCriteria,
    as_batch,
    check_context,
    compile_reads,
    model_forward,
    prefill,
)
from lmpress.runtime.kv_cache import KVCache
from lmpress.runtime.model import Transformer
from lmpress.runtime.sample import SamplingConfig, draw, make_generator, next_token_probs


@dataclass
class SpeculativeStats:
    target_steps: int = 0  # target forwards after the prefill, each verifying one round of drafts
    drafted: int = 0
    accepted: int = 0
    step_tokens: int = 0  # tokens those forwards produced (accepted drafts plus one each)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.step_tokens / self.target_steps if self.target_steps else 0.0


def verify(
    target_probs: torch.Tensor,
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens a round emits: the accepted prefix of ``drafts`` and one token from the target.

    ``target_probs`` ``(len(drafts) + 1, vocab)``: the target's distribution at each draft's
    position and after the last one; ``draft_probs`` ``(len(drafts), vocab)``, the
    distributions the drafts were drawn from (None: drafts chosen deterministically).
    """
    out: list[int] = []
    for i, token in enumerate(drafts):
        p = target_probs[i]
        q_token = float(draft_probs[i, token]) if draft_probs is not None else 1.0  # deterministic: one-hot q
        # Leviathan et al. 2023: accept x ~ q with probability min(1, p(x) / q(x)) ...
        if p[token] >= q_token or (p[token] > 0 and float(torch.rand(1, generator=generator)) < p[token] / q_token):
            out.append(token)
            continue
        # ... else draw from norm(max(0, p - q)), which makes the emitted token exactly p-distributed.
        if draft_probs is not None:
            residual = (p - draft_probs[i]).clamp(min=0)
        else:
            residual = p.clone()
            residual[token] = 0.0
        out.append(
            int(draw((residual / residual.sum())[None], generator)[0]) if residual.sum() > 0 else int(p.argmax())
        )
        return out
    out.append(int(draw(target_probs[len(drafts)][None], generator)[0]))
    return out


def verify_greedy(target_best: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """``verify`` for greedy decoding, where every distribution is one-hot: the drafts up to the first that is
    not the target's argmax ``target_best`` (one per draft and one after the last), then the target's token."""
    n = _common_prefix(list(drafts), list(target_best))
    return list(drafts[:n]) + [target_best[n]]


class ModelDrafter:
    """Draws k tokens from a draft model, keeping its KV cache in step with the accepted text.

    Its reads run ``forward`` (``compiled_forward()``, say): one token per step, and at the start of
    a round the tokens accepted since the last one, several at once.
    """

    def __init__(
        self,
        model: Transformer,
        max_len: int,
        sampling: SamplingConfig,
        generator: torch.Generator,
        forward: ForwardFn = model_forward,
    ) -> None:
        self.model, self.sampling, self.generator, self.forward = model, sampling, generator, forward
        self.cache = model.new_cache(1, min(max_len, model.args.max_seq_len))
        self.cached: list[int] = []  # the tokens whose keys/values the cache holds

    def room(self, seq_len: int) -> int:
        """How many drafts fit after ``seq_len`` tokens (it reads all but the last draft)."""
        return self.cache.max_len - seq_len + 1

    @torch.no_grad()
    def read_prompt(self, prompt: list[int]) -> None:
        """Read the prompt into the cache, as the target's prefill does (the first round then reads one token)."""
        self.cache.reset()
        prefill(self.model, torch.tensor([prompt]), self.cache)
        self.cached = list(prompt)

    @torch.no_grad()
    def propose(self, seq: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        keep = min(_common_prefix(self.cached, seq), len(seq) - 1)  # re-read at least the last token
        self.cache.truncate(keep)
        self.cached = self.cached[:keep]
        pending = seq[keep:]
        drafts, probs = [], []
        for _ in range(k):
            logits = read(self.forward, self.model, pending, self.cache, True)[:, -1]
            self.cached += pending
            if self.sampling.argmax_only:  # no distribution built: the argmax of the rows it scores
                token = scored_argmax(self.model, logits)
            else:
                q = next_token_probs(whole_vocabulary(self.model, logits), self.sampling, torch.tensor([seq + drafts]))
                token = int(draw(q, self.generator)[0])
                probs.append(q[0])
            drafts.append(token)
            pending = [token]
        return drafts, torch.stack(probs) if probs else None


def scored_argmax(model: Transformer, logits: torch.Tensor) -> int:
    """The token id of the largest of ``logits`` ``(1, n)``, the scores of ``model.output_tokens`` when it has them
    (ascending ids, so ties go to the lowest id as over the whole vocabulary)."""
    best = int(logits.argmax())
    return int(model.output_tokens[best]) if model.output_tokens is not None else best


def whole_vocabulary(model: Transformer, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` ``(rows, n)`` of a model that scores part of the vocabulary as ``(rows, vocab)`` on the CPU, the
    tokens it does not score at -inf (never drawn)."""
    logits = logits.cpu()
    if model.output_tokens is None:
        return logits
    whole = logits.new_full((logits.shape[0], model.args.vocab_size), float("-inf"))
    whole[:, model.output_tokens] = logits
    return whole


def restrict_vocabulary(draft: Transformer, tokens: torch.Tensor) -> None:
    """Make ``draft`` score only ``tokens`` (its output layer cut to their rows): FR-Spec (Zhao et al. 2025).

    A draft's output layer over a large vocabulary is a large part of a draft step (SmolLM2's
    49,152 x 576 head is half of a W4 half-depth draft's bytes). The target still verifies over
    the whole vocabulary, so the output does not change; a token outside ``tokens`` is only never
    proposed. ``frequent_tokens`` picks them from a text.
    """
    tokens = torch.as_tensor(tokens, dtype=torch.long).unique()
    if tokens.numel() == 0 or tokens[0] < 0 or tokens[-1] >= draft.args.vocab_size:
        raise LmpressInputError(f"a draft vocabulary needs token ids in [0, {draft.args.vocab_size})")
    from lmpress.runtime.kernels.cpu import output_rows

    draft.output = output_rows(draft.output, tokens.to(draft.device))
    draft.output_tokens = tokens


def frequent_tokens(ids: torch.Tensor, n: int, vocab_size: int) -> torch.Tensor:
    """The ``n`` most frequent token ids of ``ids`` (ties to the lower id), ascending."""
    if not 1 <= n <= vocab_size:
        raise LmpressInputError(f"a draft vocabulary of {n} tokens: choose 1 to {vocab_size}")
    counts = torch.bincount(ids.flatten(), minlength=vocab_size)[:vocab_size]
    return torch.argsort(counts, descending=True, stable=True)[:n].sort().values


class PromptLookupDrafter:
    """Drafts by n-gram lookup: the tokens that followed the latest earlier occurrence of the text's last n tokens."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise LmpressInputError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def room(self, seq_len: int) -> int:
        return seq_len

    def read_prompt(self, prompt: list[int]) -> None:
        """Nothing to read: the lookup searches the text itself."""

    def propose(self, seq: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            pattern = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start : start + n] == pattern:
                    return seq[start + n : start + n + k], None
        return [], None


def read(
    forward: ForwardFn,
    model: Transformer,
    tokens: list[int],
    cache: KVCache,
    last_only: bool = False,
    feature_layers: tuple[int, ...] = (),
) -> Any:
    """Float logits ``(1, n, vocab)`` (``(1, 1, vocab)`` for the last token with ``last_only``) for ``tokens``
    read after the cache: a few through ``forward``, more (a prompt) through the model's own forward,
    whose attention is built for long reads and which then skips the output layer for all but the last.
    With ``feature_layers``, ``(logits, features)``: what a draft head reads of every token (``model_forward``)."""
    ids = torch.tensor([tokens])
    if feature_layers:
        few = len(tokens) <= FEW_QUERIES
        logits, features = (
            forward(model, ids, cache, feature_layers) if few else model_forward(model, ids, cache, feature_layers)
        )
        return (logits[:, -1:] if last_only else logits).float(), features
    if len(tokens) > FEW_QUERIES:
        return model(ids, cache, last_only=last_only).float()
    logits = forward(model, ids, cache)
    return logits[:, -1:] if last_only else logits


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def check_same_vocabulary(
    target: Transformer, draft: Transformer, target_tok: Any = None, draft_tok: Any = None
) -> None:
    """A draft must speak the target's token ids: same vocabulary size and, where given, the same tokenizer."""
    if target.args.vocab_size != draft.args.vocab_size:
        raise LmpressInputError(
            f"the draft's vocabulary has {draft.args.vocab_size} tokens, the target's {target.args.vocab_size}: "
            "use a draft with the target's tokenizer"
        )
    if target_tok is not None and draft_tok is not None and target_tok.get_vocab() != draft_tok.get_vocab():
        raise LmpressInputError("the draft's tokenizer differs from the target's: use a draft with the same tokenizer")


K_MAX = 8  # the longest round speculative_decode drafts by default


def cache_slots(target: Transformer, prompt_len: int, max_new_tokens: int) -> int:
    """The cache size speculative decoding gives both models: the prompt and all new tokens but the last."""
    return min(prompt_len + max_new_tokens - 1, target.args.max_seq_len)


def compile_rounds(
    forward: ForwardFn,
    target: Transformer,
    draft: Transformer | None,
    prompt_len: int,
    max_new_tokens: int,
    draft_head: Eagle3Head | None = None,
    head_step: HeadStep | None = None,
) -> None:
    """Compile every read a speculative decode with these sizes may make through ``forward`` (the target's
    verifications of up to ``K_MAX`` drafts, with a draft head's features where it drafts; the draft's steps of
    one or two tokens; the head's steps through ``head_step``, one position and several), so none compiles inside
    a timed run."""
    capacity = cache_slots(target, prompt_len, max_new_tokens)
    layers = draft_head.config.feature_layers if draft_head is not None else ()
    compile_reads(forward, target, capacity, range(1, K_MAX + 2), layers)
    if draft is not None:
        compile_reads(forward, draft, min(capacity, draft.args.max_seq_len), (1, 2))
    if draft_head is not None and head_step is not None:
        greedy = SamplingConfig(temperature=0.0)
        Eagle3Drafter(draft_head, target, capacity, greedy, torch.Generator(), head_step).compile_steps()


class AdaptiveK:
    """The draft length of each round, chosen to maximize expected tokens per second.

    With a per-token acceptance rate ``a``, a round of ``k`` drafts emits ``(1 - a**(k+1)) / (1 - a)``
    tokens in expectation (Leviathan et al. 2023, eq. 1) and costs one target forward over ``k + 1``
    tokens plus ``k`` draft steps. ``a`` is estimated as that model has it: each round tries its
    drafts in turn until the first rejection, so it made ``accepted + 1`` trials (``accepted`` when
    all were taken) with ``accepted`` successes; recent rounds' counts weigh most. (Accepted over
    drafted counts the drafts after a rejection as failures too: at a = 0.74, three-draft rounds
    read as 0.56, and rounds were chosen too short.) Both
    costs are timed as rounds run: on a CPU a forward over 9 tokens costs 2-3 single-token
    steps, on a GPU about one. A length not timed yet is priced by a line through the
    timings so far (optimistically, 10% of a step per extra token, while only one length has
    been timed), so longer rounds get tried. Where no round of drafts is expected to emit tokens faster than
    reading one token alone (``k = 0``: a plain step), rounds stop drafting; every ``PROBE_ROUNDS`` plain rounds
    one round drafts again, so a text on which drafting starts to pay finds it.
    """

    SMOOTHING = 0.3  # weight of the newest round in the running averages
    PROBE_ROUNDS = 8

    def __init__(self, k: int, k_max: int, adaptive: bool) -> None:
        if not 1 <= k <= k_max:
            raise LmpressInputError(f"speculative decoding needs 1 <= k <= k_max, got k={k}, k_max={k_max}")
        self.k, self.k_max, self.adaptive = k, k_max, adaptive
        self.accepted, self.trials = 0.5, 1.0  # running counts of drafts accepted and tried (a prior of 0.5)
        self.forward_seconds: dict[int, float] = {}  # tokens verified -> seconds of one target forward
        self.draft_seconds = 0.0  # per drafted token
        self.plain_rounds = 0  # rounds without drafts since the last round with

    def update(self, drafted: int, accepted: int, forward_seconds: float = 1.0, draft_seconds: float = 0.0) -> None:
        """Record a round (``drafted`` proposed, ``accepted`` taken, its timings) and choose the next ``k``."""
        if not self.adaptive:
            return
        self.forward_seconds[drafted + 1] = self._average(self.forward_seconds.get(drafted + 1), forward_seconds)
        if drafted:
            self.accepted = self._average(self.accepted, accepted)
            self.trials = self._average(self.trials, accepted + (accepted < drafted))
            self.draft_seconds = self._average(self.draft_seconds or None, draft_seconds / drafted)
        self.plain_rounds = 0 if drafted else self.plain_rounds + 1
        self.k = max(range(self.k_max + 1), key=lambda k: self.expected_tokens(k) / self.round_seconds(k))
        if self.k == 0 and self.plain_rounds >= self.PROBE_ROUNDS:
            self.k = 1

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.SMOOTHING) * old + self.SMOOTHING * new

    @property
    def acceptance(self) -> float:
        return self.accepted / self.trials

    def expected_tokens(self, k: int) -> float:
        return sum(self.acceptance**i for i in range(k + 1))

    def round_seconds(self, k: int) -> float:
        return self.forward_cost(k + 1) + k * self.draft_seconds

    def forward_cost(self, n: int) -> float:
        if n in self.forward_seconds:
            return self.forward_seconds[n]
        points = sorted(self.forward_seconds.items())
        if len(points) == 1:
            n0, t0 = points[0]
            return max(t0 * (1 + 0.1 * (n - n0)), 1e-9)
        xs, ys = torch.tensor([float(x) for x, _ in points]), torch.tensor([y for _, y in points])
        slope = float(((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum())
        return max(float(ys.mean()) + max(slope, 0.0) * (n - float(xs.mean())), 1e-9)


@trims_heap_after
def speculative_decode(
    target: Transformer,
    prompt: Sequence[int] | torch.Tensor,
    draft: Transformer | None = None,
    max_new_tokens: int = 128,
    sampling: SamplingConfig | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop_strings: Sequence[str] = (),
    tokenizer: Any = None,
    seed: int | None = None,
    k: int = 4,
    k_max: int = K_MAX,
    adaptive: bool = True,
    prompt_lookup: PromptLookupDrafter | None = None,
    stats: SpeculativeStats | None = None,
    forward: ForwardFn = model_forward,
    draft_head: Eagle3Head | None = None,
    head_step: HeadStep | None = None,
) -> Iterator[int]:
    """Yield the target's tokens as rounds accept them: from ``draft``, an EAGLE-3 ``draft_head`` reading the
    target's features, or ``prompt_lookup`` when neither is given.

    The prefill reads the prompt into the draft's cache as well as the target's, before the first
    token. Same stopping rules and token budget as ``generate_tokens``; ``stats`` (if given)
    is filled in as it runs: acceptance rate and tokens per target step. ``forward`` runs the
    draft's steps and the target's verifying reads (e.g. ``compiled_forward()``), ``head_step`` a draft head's
    (e.g. ``compiled_head_step()``; default: op by op).
    """
    sampling = sampling or SamplingConfig()
    batch = as_batch(prompt)
    if len(batch) != 1:
        raise LmpressInputError(f"speculative decoding takes one prompt, got a batch of {len(batch)}")
    if max_new_tokens < 1:
        raise LmpressInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    seq = batch[0]
    check_context(len(seq), target.args.max_seq_len)
    if draft is not None:
        check_same_vocabulary(target, draft)
    stats = stats if stats is not None else SpeculativeStats()
    stops = StopCriteria(eos_token_id, stop_strings, tokenizer)
    generator = make_generator(seed)
    capacity = cache_slots(target, len(seq), max_new_tokens)
    n_new = capacity - len(seq) + 1  # as many tokens as plain decoding would give
    if draft_head is not None:
        drafter = Eagle3Drafter(draft_head, target, capacity, sampling, generator, head_step)
    elif draft is not None:
        drafter = ModelDrafter(draft, capacity, sampling, generator, forward)
    else:
        drafter = prompt_lookup or PromptLookupDrafter()
    draft_len = AdaptiveK(k, k_max, adaptive)
    cache = target.new_cache(1, capacity)
    prompt_len = len(seq)
    with torch.no_grad():
        if isinstance(drafter, Eagle3Drafter):
            logits, features = target.forward_with_features(torch.tensor([seq]), cache, drafter.feature_layers, True)
            logits = logits[:, -1].float().cpu()
        else:
            logits = prefill(target, torch.tensor([seq]), cache).cpu()
    drafter.read_prompt(seq)  # part of the prefill, as the target's read: not left to the first round
    if isinstance(drafter, Eagle3Drafter):
        drafter.take_features(features[0])
    emitted = [int(draw(next_token_probs(logits, sampling, torch.tensor([seq])), generator)[0])]
    while True:
        for token in emitted:
            seq.append(token)
            yield token
            if stops.done(seq[prompt_len:]) or len(seq) - prompt_len == n_new:
                return
        remaining = n_new - (len(seq) - prompt_len)
        drafted, emitted = _round(target, forward, cache, seq, drafter, draft_len, remaining, sampling, generator)
        stats.target_steps += 1
        stats.step_tokens += len(emitted)
        stats.drafted += drafted
        stats.accepted += len(emitted) - 1


@torch.no_grad()
def _round(
    target: Transformer,
    forward: ForwardFn,
    cache: KVCache,
    seq: list[int],
    drafter: ModelDrafter | PromptLookupDrafter | Eagle3Drafter,
    draft_len: AdaptiveK,
    remaining: int,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> tuple[int, list[int]]:
    """One draft-and-verify round: how many tokens were drafted, and the tokens it emits (at least one)."""
    # The target has read all of seq but its last token; anything past that was rejected drafts.
    cache.truncate(len(seq) - 1)
    k = max(0, min(draft_len.k, remaining - 1, drafter.room(len(seq))))
    began = time.perf_counter()
    drafts, draft_probs = drafter.propose(seq, k) if k else ([], None)
    drafted = time.perf_counter()
    features = None
    if isinstance(drafter, Eagle3Drafter):  # the target's features of what it reads, for the head's next round
        logits, features = read(forward, target, seq[-1:] + drafts, cache, feature_layers=drafter.feature_layers)
        logits = logits[0].cpu()
    else:
        logits = read(forward, target, seq[-1:] + drafts, cache)[0].cpu()
    if sampling.argmax_only:
        emitted = verify_greedy(logits.argmax(dim=-1).tolist(), drafts)
    else:
        emitted = verify(_target_probs(logits, seq, drafts, sampling), drafts, draft_probs, generator)
    if features is not None:  # kept: the positions of the last token and of the accepted drafts
        drafter.take_features(features[0, : len(emitted)])
    draft_len.update(len(drafts), len(emitted) - 1, time.perf_counter() - drafted, drafted - began)
    return len(drafts), emitted


def _target_probs(logits: torch.Tensor, seq: list[int], drafts: list[int], sampling: SamplingConfig) -> torch.Tensor:
    """The target's sampling distribution at each verified position (its history includes the drafts before it)."""
    if sampling.repetition_penalty == 1.0:
        return next_token_probs(logits, sampling)
    rows = [next_token_probs(logits[i : i + 1], sampling, torch.tensor([seq + drafts[:i]])) for i in range(len(logits))]
    return torch.cat(rows)
