"""Next-token distributions and draws: greedy, temperature, top-k, top-p, repetition penalty.

Everything goes through ``next_token_probs``, which turns logits into the distribution
a token is drawn from (one-hot on the argmax for greedy decoding). Speculative
decoding compares exactly these distributions for the draft and the target, so
greedy and sampled decoding share one acceptance rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmpress.errors import LmpressInputError


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0`` is greedy decoding; ``top_k`` None or 0 keeps every token; ``top_p`` 1 keeps all mass."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise LmpressInputError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise LmpressInputError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise LmpressInputError(f"top_k must be >= 0 (0 or None: no limit), got {self.top_k}")
        if not self.repetition_penalty > 0:
            raise LmpressInputError(f"repetition_penalty must be > 0 (1: none), got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def argmax_only(self) -> bool:
        """Greedy without a repetition penalty: the next token is the argmax of the raw logits."""
        return self.greedy and self.repetition_penalty == 1.0


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """The CTRL rule (Keskar et al. 2019), as transformers applies it: a seen token's logit is divided
    by ``penalty`` when positive and multiplied by it when negative. ``history``: ``(batch, n)`` ids, -1 ignored."""
    if penalty == 1.0 or history.numel() == 0:
        return logits
    # Count, not assign: -1 entries map to id 0 and must not overwrite a real occurrence of it.
    counts = torch.zeros(logits.shape, dtype=torch.long, device=logits.device)
    seen = counts.scatter_add_(1, history.clamp(min=0), (history >= 0).long()) > 0
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def mask_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (ties at the k-th value kept), the rest to -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def mask_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al. 2020): keep the smallest set of most likely tokens whose mass reaches ``p``."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the tokens strictly before it already hold mass >= p (the first one always stays).
    before = probs.cumsum(dim=-1) - probs
    drop_sorted = before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def next_token_probs(logits: torch.Tensor, config: SamplingConfig, history: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution ``(batch, vocab)`` the next token is drawn from, given ``logits`` ``(batch, vocab)``."""
    logits = logits.float()
    if history is not None:
        logits = apply_repetition_penalty(logits, history, config.repetition_penalty)
    if config.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / config.temperature
    if config.top_k:
        logits = mask_top_k(logits, config.top_k)
    logits = mask_top_p(logits, config.top_p)
    return logits.softmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` ``(batch, vocab)``; the argmax when a row is one-hot (no random draw)."""
    if bool((probs.amax(dim=-1) == 1.0).all()):
        return probs.argmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def next_token(
    logits: torch.Tensor,
    config: SamplingConfig,
    noise: torch.Tensor | None = None,
    history: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token ids ``(batch,)`` from ``logits`` ``(batch, vocab)``, on their device and without reading anything
    back to the host, so a compiled decode step (and its CUDA graph) can end with it.

    Greedy is the argmax of the (penalized) logits. A sampled token is the exponential race over
    ``next_token_probs``: with ``noise`` independent Exp(1) draws, ``argmax(p / noise)`` is token ``i`` with
    probability ``p_i`` (``min_i E_i / p_i`` falls on ``i`` with rate ``p_i`` out of 1), the draw gpt-fast's
    ``sample`` makes; ``step_noise`` gives the draws."""
    if config.greedy:
        if history is not None:
            logits = apply_repetition_penalty(logits.float(), history, config.repetition_penalty)
        return logits.argmax(dim=-1)
    if noise is None:
        raise ValueError("a sampled token needs its noise (step_noise)")
    probs = next_token_probs(logits, config, history)
    return (probs / noise).argmax(dim=-1)


def step_noise(
    config: SamplingConfig, shape: tuple[int, ...], generator: torch.Generator, device: torch.device
) -> torch.Tensor | None:
    """The Exp(1) draws ``next_token`` samples one step with, drawn on ``device`` (None when greedy)."""
    if config.greedy:
        return None
    noise = torch.empty(shape, device=device).exponential_(generator=generator)
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # never 0 (0 / 0 is NaN); Exp(1) < tiny has p ~ 1e-38


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for draws on ``device``: its own on a GPU (the draws stay there), else the CPU's."""
    device = torch.device(device)
    generator = torch.Generator(device=device if device.type == "cuda" else "cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
