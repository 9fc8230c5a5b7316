"""The exact least-squares weights for a fixed mask, against a float64 row-by-row solve and its optimality."""

from __future__ import annotations

import pytest
import torch

from lmpress.prune.masks import nm_mask
from lmpress.prune.reconstruct import masked_least_squares
from lmpress.prune.sparsegpt import sparsegpt_prune_layer
from lmpress.prune.targets import PruneTarget
from tests.prune.test_unstructured import correlated_inputs, hessian, output_error


def reference_rows(W: torch.Tensor, H: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor:
    """Minimise (ŵ - w) H (ŵ - w)ᵀ with ŵ_P = 0 row by row in float64 (normal equations on the kept columns)."""
    W, H = W.double(), H.double()
    out = torch.zeros_like(W)
    for r in range(W.shape[0]):
        S = ~pruned[r]
        if S.any():
            # ∂/∂ŵ_S = 0: (ŵ_S - w_S) H_SS - w_P H_PS = 0, i.e. ŵ_S H_SS = w H_:S
            out[r, S] = torch.linalg.solve(H[S][:, S], W[r] @ H[:, S])
    return out


def damped(H: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    return H + damp * H.diag().mean() * torch.eye(H.shape[0])


@pytest.mark.parametrize("pattern", ["2:4", "unstructured"])
def test_matches_a_float64_row_by_row_solve(pattern):
    X = correlated_inputs(tokens=1024, cols=96, seed=3)
    H = damped(hessian(X))
    W = torch.randn(40, 96, generator=torch.Generator().manual_seed(3))
    if pattern == "2:4":
        pruned = nm_mask(torch.rand(40, 96), 2, 4)
    else:  # rows keep different numbers of columns, one keeps none, one keeps all
        pruned = torch.rand(40, 96) < torch.linspace(0.1, 0.9, 40).reshape(-1, 1)
        pruned[0], pruned[1] = True, False
    got = masked_least_squares(W, H, pruned)
    want = reference_rows(W, H, pruned)
    assert (got[pruned] == 0).all()
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4), (got.double() - want).abs().max()
    if pattern == "unstructured":
        assert torch.allclose(got[1], W[1], atol=1e-5)  # nothing pruned: w itself


def test_the_gradient_vanishes_on_kept_weights():
    X = correlated_inputs(tokens=2048, cols=128, seed=4)
    H = damped(hessian(X))
    W = torch.randn(32, 128)
    pruned = nm_mask(torch.rand(32, 128), 2, 4)
    W_hat = masked_least_squares(W, H, pruned)
    gradient = (W_hat - W) @ H
    assert gradient[~pruned].abs().max() < 1e-3 * gradient[pruned].abs().max()


@pytest.mark.parametrize("target", [PruneTarget(0.5, 2, 4), PruneTarget(0.5)], ids=["2:4", "unstructured"])
def test_sparsegpt_reconstruct_keeps_the_mask_and_lowers_the_output_error(target):
    X = correlated_inputs(seed=5)
    W = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    H = hessian(X)
    published, mask, _ = sparsegpt_prune_layer(W, H, target, block_size=64)
    solved, same_mask, _ = sparsegpt_prune_layer(W, H, target, block_size=64, reconstruct=True)
    assert torch.equal(mask, same_mask)
    assert torch.equal(solved == 0, mask)
    assert output_error(W, solved, X) < 0.98 * output_error(W, published, X)


def test_parts_solve_every_row_once_and_as_the_whole_solve(monkeypatch):
    """Processes sharing one linear's reconstruction (``part``) solve disjoint chunks of rows that cover every
    row, each bit for bit what one process solves (small chunks here, so three parts each get several)."""
    from lmpress.prune import reconstruct

    monkeypatch.setattr(reconstruct, "CHUNK_ELEMENTS", 4 * 96 * 96)
    X = correlated_inputs(tokens=1024, cols=96, seed=4)
    H = damped(hessian(X))
    W = torch.randn(40, 96, generator=torch.Generator().manual_seed(4))
    pruned = torch.rand(40, 96, generator=torch.Generator().manual_seed(5)) < torch.linspace(0.1, 0.9, 40)[:, None]
    whole = masked_least_squares(W, H, pruned)
    rows = [reconstruct.solved_rows(pruned, (i, 3)) for i in range(3)]
    assert sorted(torch.cat(rows).tolist()) == list(range(40)) and all(len(r) for r in rows)
    for i in range(3):
        part = masked_least_squares(W, H, pruned, (i, 3))
        assert torch.equal(part[rows[i]], whole[rows[i]])
        others = torch.ones(40, dtype=torch.bool)
        others[rows[i]] = False
        assert (part[others] == 0).all()
