"""Per-token measures of a model's predictions that the evals, the exporters' checks, pruning and
distillation all score with."""

from __future__ import annotations

import torch


def token_nll(logits: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """Next-token NLL, shape ``(batch, seq_len - 1)``: position t scores token t+1."""
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    return -logprobs.gather(-1, windows[:, 1:, None].to(logits.device)).squeeze(-1)


def exact_kld(base_logprobs: torch.Tensor, cand_logprobs: torch.Tensor) -> torch.Tensor:
    """The full-vocabulary KL(P || Q) per row in float64: the reference both modes are tested against."""
    p = base_logprobs.double()
    return (p.exp() * (p - cand_logprobs.double())).sum(-1)
