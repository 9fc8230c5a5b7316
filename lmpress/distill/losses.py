"""Distillation losses: divergences between teacher and student logits, and hidden-state matching.

Logit divergences are computed in chunks of positions, each in float32 and (when
gradients are needed) recomputed in the backward pass, so no more than one chunk of
``(positions, vocab)`` float32 probabilities is alive at a time, however long the
sequence: at SmolLM2's vocabulary of 49,152 a 4 x 2048-token batch would otherwise
hold ~1.6 GB per copy.

With temperature ``T`` both distributions are softened (``softmax(z / T)``) and the
divergence is scaled by ``T²`` so its gradient keeps the magnitude of ``T = 1``
(Hinton et al. 2015, §2).

- forward KL  ``KL(p_t || p_s)``: mean-seeking, the classic distillation loss;
- reverse KL  ``KL(p_s || p_t)``: mode-seeking (MiniLLM, Gu et al. 2024);
- JSD         ``½ KL(p_t || m) + ½ KL(p_s || m)``, ``m = ½ (p_t + p_s)``: bounded by ln 2.

A teacher read from the on-disk cache is sparse (its top-k log-probabilities, see
``teacher.py``): only forward KL is defined on it, over those k tokens with the
teacher's probabilities renormalized (the tail the cache dropped counts as zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]
HiddenLoss = Literal["mse", "cosine"]
DEFAULT_CHUNK = 1024  # positions per chunk


@dataclass
class SparseTeacher:
    """The teacher's top-k tokens per position: log-probabilities at temperature 1 and their ids,
    both ``(batch, seq, k)``."""

    logprobs: torch.Tensor
    indices: torch.Tensor


def _divergence_sum(student: torch.Tensor, teacher: torch.Tensor, kind: Divergence, temperature: float) -> torch.Tensor:
    """Σ over the rows of ``student``/``teacher`` (positions, vocab) of the per-position divergence."""
    log_s = F.log_softmax(student.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher.float() / temperature, dim=-1)
    if kind == "forward_kl":
        return F.kl_div(log_s, log_t, log_target=True, reduction="sum")  # Σ p_t (log p_t - log p_s)
    if kind == "reverse_kl":
        return F.kl_div(log_t, log_s, log_target=True, reduction="sum")  # Σ p_s (log p_s - log p_t)
    log_m = torch.logsumexp(torch.stack([log_s, log_t]), dim=0) - math.log(2)  # log ½ (p_s + p_t)
    teacher_side = F.kl_div(log_m, log_t, log_target=True, reduction="sum")
    return 0.5 * (teacher_side + F.kl_div(log_m, log_s, log_target=True, reduction="sum"))


def _sparse_forward_kl_sum(student: torch.Tensor, logprobs: torch.Tensor, indices: torch.Tensor, temperature: float):
    log_s = F.log_softmax(student.float() / temperature, dim=-1).gather(-1, indices.long())
    log_t = F.log_softmax(logprobs.float() / temperature, dim=-1)  # renormalized over the k kept tokens
    return (log_t.exp() * (log_t - log_s)).sum()


def logit_divergence(
    student: torch.Tensor,
    teacher: torch.Tensor | SparseTeacher,
    kind: Divergence = "forward_kl",
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Mean over positions (those where ``mask`` is True) of the divergence, times ``T²``.

    ``student`` ``(batch, seq, vocab)``; ``teacher`` the same shape, or a :class:`SparseTeacher`.
    """
    sparse = isinstance(teacher, SparseTeacher)
    if sparse and kind != "forward_kl":
        raise ValueError(f"a cached (top-k) teacher supports forward_kl only, not {kind}")
    vocab = student.shape[-1]
    rows = torch.ones(student.shape[:-1], dtype=torch.bool, device=student.device) if mask is None else mask
    keep = rows.reshape(-1).nonzero().squeeze(-1)
    flat_s = student.reshape(-1, vocab)
    if sparse:
        k = teacher.logprobs.shape[-1]
        targets = (teacher.logprobs.reshape(-1, k), teacher.indices.reshape(-1, k))
    else:
        targets = (teacher.reshape(-1, vocab).detach(),)
    total = student.new_zeros((), dtype=torch.float32)
    for start in range(0, keep.numel(), chunk):
        index = keep[start : start + chunk]
        args = (flat_s[index], *(t[index] for t in targets))
        if sparse:
            part = lambda s, lp, ix: _sparse_forward_kl_sum(s, lp, ix, temperature)  # noqa: E731
        else:
            part = lambda s, t: _divergence_sum(s, t, kind, temperature)  # noqa: E731
        total = total + (checkpoint(part, *args, use_reentrant=False) if student.requires_grad else part(*args))
    return total * temperature**2 / max(keep.numel(), 1)


def hidden_state_loss(
    student: torch.Tensor, teacher: torch.Tensor, kind: HiddenLoss = "mse", mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over positions of ``‖h_s − h_t‖² / d`` (mse) or ``1 − cos(h_s, h_t)`` (cosine); ``(batch, seq, d)``."""
    s, t = student.float(), teacher.float().detach()
    per_position = (s - t).pow(2).mean(-1) if kind == "mse" else 1 - F.cosine_similarity(s, t, dim=-1)
    if mask is None:
        return per_position.mean()
    return (per_position * mask).sum() / mask.sum().clamp(min=1)
