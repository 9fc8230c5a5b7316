"""Pruning masks from importance scores (True = pruned). Lower score = pruned first."""

from __future__ import annotations

import torch


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the ``n`` highest-scoring of every ``m`` consecutive entries of each row; prune the rest."""
    rows, cols = scores.shape
    if cols % m:
        raise ValueError(f"M={m} does not divide the row length {cols}")
    groups = scores.reshape(rows, cols // m, m)
    pruned = torch.zeros_like(groups, dtype=torch.bool)
    pruned.scatter_(2, torch.topk(groups, m - n, dim=2, largest=False).indices, True)
    return pruned.reshape(rows, cols)


def row_mask(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Prune the ``int(cols * sparsity)`` lowest-scoring entries of each row (Wanda's per-output comparison group)."""
    rows, cols = scores.shape
    k = int(cols * sparsity)
    pruned = torch.zeros_like(scores, dtype=torch.bool)
    if k:
        pruned.scatter_(1, torch.topk(scores, k, dim=1, largest=False).indices, True)
    return pruned


def matrix_mask(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Prune the ``int(numel * sparsity)`` lowest-scoring entries of the whole matrix."""
    k = int(scores.numel() * sparsity)
    pruned = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    if k:
        pruned[torch.topk(scores.flatten(), k, largest=False).indices] = True
    return pruned.reshape(scores.shape)


def nm_pattern(weight: torch.Tensor) -> str | None:
    """``"2:4"`` or ``"4:8"`` when every group of M along each row of ``weight`` has at least M - N zeros."""
    rows, cols = weight.shape
    for n, m in ((2, 4), (4, 8)):
        if cols % m == 0 and bool(((weight.reshape(rows, -1, m) == 0).sum(-1) >= m - n).all()):
            return f"{n}:{m}"
    return None
