"""Per-token measures of a model's predictions that the evals, the exporters' checks, pruning and
distillation all score with."""

from __future__ import annotations

import torch


def token_nll(logits: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """Next-token NLL, shape ``(batch, seq_len - 1)``: position t scores token t+1."""
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    return -logprobs.gather(-1, windows[:, 1:, None].to(logits.device)).squeeze(-1)


NLL_CHUNK = 1024  # positions per log-softmax in mean_token_nll: 201 MB for a 49k vocabulary, not a window's


def mean_token_nll(logits: torch.Tensor, window: torch.Tensor, chunk: int = NLL_CHUNK) -> float:
    """``token_nll(logits, window).mean()`` of one ``(1, seq_len)`` window, the log-softmax taken ``chunk``
    positions at a time: an 8,192-token window's whole log-softmax would double its logits (1.6 GB for SmolLM2)."""
    targets = window[0, 1:].to(logits.device)
    total = 0.0
    for start in range(0, targets.shape[0], chunk):
        part = torch.log_softmax(logits[0, start : min(start + chunk, targets.shape[0])].float(), dim=-1)
        total -= part.gather(-1, targets[start : start + part.shape[0], None]).double().sum().item()
    return total / targets.shape[0]


def exact_kld(base_logprobs: torch.Tensor, cand_logprobs: torch.Tensor) -> torch.Tensor:
    """The full-vocabulary KL(P || Q) per row in float64: the reference both modes are tested against."""
    p = base_logprobs.double()
    return (p.exp() * (p - cand_logprobs.double())).sum(-1)
