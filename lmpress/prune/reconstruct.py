"""The least-squares weights of a pruned linear for a fixed mask.

Once a mask is chosen, the layer-wise problem of SparseGPT (Frantar & Alistarh 2023,
Eq. 1), min ||W X - Ŵ X||² over Ŵ that are zero where pruned, has a closed form per
output row: with S the kept columns of a row, P the pruned ones and H = 2 X Xᵀ,

    ŵ_S = w_S + w_P H_PS H_SS⁻¹        (ŵ_P = 0)

(set the gradient of (ŵ - w) H (ŵ - w)ᵀ over ŵ_S to zero). SparseGPT's column loop
reaches this optimum only approximately: a pruned column's error is compensated on
later columns alone, through the inverse Hessian of the columns still unvisited.
Solving each row exactly keeps SparseGPT's mask and lowers the layer's output error
(by 15-30% on SmolLM2-135M at 2:4; the same finding as Boža 2024, "Fast and
Effective Weight Update for Pruned Large Language Models", whose ADMM iterations
converge to this solution).

Rows are solved in chunks with a batched Cholesky factorization of their H_SS; rows
keeping different numbers of columns (unstructured masks) are grouped by that number
and padded to the widest row of their chunk with dummy unknowns, decoupled from the
rest, whose solution is zero.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 24  # a chunk's H_SS blocks hold at most this many floats (64 MiB)


@torch.no_grad()
def masked_least_squares(
    W: torch.Tensor, H: torch.Tensor, pruned: torch.Tensor, part: tuple[int, int] = (0, 1)
) -> torch.Tensor:
    """The rows of ``W`` (out, in) re-solved for the mask ``pruned`` (True = zero) against ``H`` (in, in), which
    must be positive definite (damped); returns float32 weights, exactly zero where pruned.

    ``part`` ``(i, n)``: solve only every n-th chunk of rows from the i-th (the other rows stay zero), so ``n``
    processes share one linear; each chunk is the same computation whichever process runs it, so the rows the
    parts solve are bit for bit one process's (``solved_rows`` says which a part holds)."""
    rows, cols = W.shape
    W = W.float()
    kept = ~pruned
    counts = kept.sum(1)
    # Rows by how many columns they keep, so that each chunk is padded only to its own widest row
    # (an N:M mask keeps the same number in every row: the rows stay in order).
    row_order = torch.sort(counts, stable=True).indices
    # Each row's kept columns first (in column order); slots past a row's count point at the dummy column ``cols``.
    col_order = torch.sort(pruned.to(torch.int8), dim=1, stable=True).indices
    H_pad = torch.zeros(cols + 1, cols + 1, dtype=torch.float32, device=W.device)
    H_pad[:cols, :cols] = H.float()
    # w_P H_PS for every row at once: (w ⊙ pruned) H, read at each row's kept columns
    rhs_full = torch.nn.functional.pad(W.masked_fill(kept, 0) @ H.float(), (0, 1))
    W_pad = torch.nn.functional.pad(W, (0, 1))
    out = torch.zeros(rows, cols, dtype=torch.float32, device=W.device)
    for index, (chunk, width) in enumerate(_row_chunks(counts, row_order)):
        if width == 0 or index % part[1] != part[0]:
            continue  # rows that keep nothing stay zero; another part's rows too
        idx = col_order[chunk, :width]
        idx = torch.where(torch.gather(kept[chunk], 1, idx), idx, torch.full_like(idx, cols))
        H_SS = H_pad[idx.unsqueeze(2), idx.unsqueeze(1)]
        pad = idx == cols  # each padded slot an independent unknown with H = 1 and no right-hand side
        H_SS.diagonal(dim1=1, dim2=2).masked_fill_(pad, 1.0)
        rhs = torch.gather(rhs_full[chunk], 1, idx).unsqueeze(2)
        delta = torch.cholesky_solve(rhs, torch.linalg.cholesky(H_SS)).squeeze(2)
        solved = torch.zeros(len(chunk), cols + 1, dtype=torch.float32, device=W.device)
        solved.scatter_(1, idx, torch.gather(W_pad[chunk], 1, idx) + delta)
        out[chunk] = solved[:, :cols]
    return out.masked_fill(pruned, 0)


def _row_chunks(counts: torch.Tensor, row_order: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """The rows (``row_order``: sorted by kept columns) in chunks whose H_SS blocks fit ``CHUNK_ELEMENTS``, each
    with its widest row's kept count."""
    chunks, r1, rows = [], 0, len(row_order)
    while r1 < rows:
        width = int(counts[row_order[r1]])
        r2 = min(rows, r1 + max(1, CHUNK_ELEMENTS // max(width, 1) ** 2))
        width = int(counts[row_order[r2 - 1]])  # the widest row of the chunk (rows are sorted)
        r2 = min(r2, r1 + max(1, CHUNK_ELEMENTS // max(width, 1) ** 2))
        chunks.append((row_order[r1:r2], width))
        r1 = r2
    return chunks


def solved_rows(pruned: torch.Tensor, part: tuple[int, int]) -> torch.Tensor:
    """The rows ``masked_least_squares(..., part)`` solves, sorted."""
    counts = (~pruned).sum(1)
    chunks = _row_chunks(counts, torch.sort(counts, stable=True).indices)
    mine = [chunk for i, (chunk, _) in enumerate(chunks) if i % part[1] == part[0]]
    return torch.sort(torch.cat(mine)).values if mine else torch.zeros(0, dtype=torch.long)
