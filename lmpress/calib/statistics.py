"""Statistics of a linear's calibration inputs that one-shot methods share.

- :class:`HessianAccumulator`: H = 2 X Xᵀ of a linear's inputs (GPTQ, Eq. 1 of
  Frantar et al. 2022; SparseGPT's layer-wise problem is the same, Frantar &
  Alistarh 2023, §3), and :func:`inverse_hessian_factor`, the upper Cholesky factor
  of its damped inverse, which GPTQ's and SparseGPT's column loops both read;
- :class:`InputNormAccumulator`: the squared L2 norm of each input feature over
  every token, ||X_j||² (Wanda's activation term, Sun et al. 2023, Eq. 1);
- :class:`InputAmaxAccumulator`: max |X| over every token (NVFP4 activations' static
  global scale; the Hessian accumulator keeps it too).

:func:`group_hessians` / :func:`group_input_norms` / :func:`group_input_amax` gather them for one group of
linears in one pass over the calibration batches; linears fed the very same input
tensor (q/k/v; gate/up; the experts of a MoE block) share one accumulator, and a
group's statistics are cached on the session until the group is finished, so
several methods of one pass (SparseGPT then GPTQ) read the same Hessian.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from lmpress.calib.expert_ranks import experts_by_block, owned_expert_hessians
from lmpress.calib.hooks import first_input
from lmpress.calib.ranks import count_across_ranks, max_across_ranks_, sum_across_ranks

if TYPE_CHECKING:
    from lmpress.calib.session import LayerSession

MAX_DAMP = 1.0
GRAM_BLOCK = 256
SOLVE_ROWS = 512  # rows of the triangular inverse computed at once: n x 512 temporaries


class HessianAccumulator:
    """H = 2/n Σ x xᵀ over every token seen (read as float32), and ``amax``, max |x| over every element seen
    (reduced by max; NVFP4 W4A4's static activation scale reads it).

    Each batch's xᵀx is a float32 product added to a float64 sum, and H is the sum's float32 rounding once every
    batch is in: float64 sums of the same float32 products in another grouping (the batches spread over
    launched processes and summed across them) differ by ~1e-16 relative, far below float32's rounding, so H,
    and GPTQ's codes, come out the same whichever processes saw which batches (a float32 running mean moved by
    ~1e-7 and flipped rounding ties: 9% of SmolLM2's codes). Only the blocks on and above the diagonal are
    summed (xᵀx is symmetric), one float64 tensor per block of rows: about a float32 matrix's memory.
    """

    def __init__(self, columns: int, device: torch.device | str = "cpu", block: int = GRAM_BLOCK) -> None:
        self.columns, self.block = columns, block
        self._sums: list[torch.Tensor] | None = [
            torch.zeros(min(block, columns - i), columns - i, dtype=torch.float64, device=device)
            for i in range(0, columns, block)
        ]
        self._H: torch.Tensor | None = None
        self.amax = torch.zeros((), dtype=torch.float32, device=device)
        self.n = 0
        self._taken = False

    def add(self, x: torch.Tensor) -> None:
        if self._sums is None:
            raise RuntimeError("this Hessian was already read; it takes no more inputs")
        x = x.reshape(-1, x.shape[-1]).float()
        if x.shape[0] == 0:
            return
        _track_amax(self.amax, x)
        self.n += x.shape[0]
        for block, i in zip(self._sums, range(0, self.columns, self.block), strict=True):
            block.add_(x[:, i : i + self.block].T @ x[:, i:])  # float32 product, float64 sum

    def reduce_across_ranks(self) -> None:
        """Every rank's sums turned into the sums over every rank's tokens (float64; amax by max)."""
        if self._sums is None:
            raise RuntimeError("this Hessian was already read; reduce it before")
        self._sums = [sum_across_ranks(block) for block in self._sums]
        max_across_ranks_(self.amax)
        self.n = count_across_ranks(self.n)

    @property
    def H(self) -> torch.Tensor:
        if self._taken:
            raise RuntimeError("this Hessian was taken by its last reader (take()); it holds nothing now")
        if self._H is None:
            self._H = self._finish()
        return self._H

    def _finish(self) -> torch.Tensor:
        """The float32 H from the float64 sums (each block freed as it is read), mirrored below the diagonal."""
        cols, sums = self.columns, self._sums
        self._sums = None
        H = torch.empty(cols, cols, dtype=torch.float32, device=sums[0].device)
        for k, i in enumerate(range(0, cols, self.block)):
            j = min(i + self.block, cols)
            H[i:j, i:] = sums[k].mul_(2 / max(self.n, 1))
            sums[k] = None  # type: ignore[call-overload]
            H[j:, i:j] = H[i:j, j:].T
        return H

    def take(self) -> torch.Tensor:
        """H, handed to a last reader that may overwrite it (GPTQ factors its inverse in H's own storage, saving
        an n x n copy); the accumulator holds nothing afterwards."""
        H = self.H
        self._H, self._taken = None, True
        return H


def _track_amax(amax: torch.Tensor, x: torch.Tensor) -> None:
    low, high = torch.aminmax(x)  # no |x| copy of the batch
    torch.maximum(amax, torch.maximum(-low, high).float(), out=amax)


class InputAmaxAccumulator:
    """max |x| over every element seen (float32 scalar), reduced by max: NVFP4 W4A4's static activation range."""

    def __init__(self, columns: int, device: torch.device | str = "cpu") -> None:
        self.amax = torch.zeros((), dtype=torch.float32, device=device)

    def add(self, x: torch.Tensor) -> None:
        if x.numel():
            _track_amax(self.amax, x.detach())

    def reduce_across_ranks(self) -> None:
        max_across_ranks_(self.amax)


class InputNormAccumulator:
    """Σ x_j² over every token seen, per input feature j: ||X_j||² (Wanda, Eq. 1). Summed in float64 (a vector:
    cheap), so the order batches arrive in, or the processes they are spread over, moves the sums by ~1e-16
    relative, below float32's rounding of ||X_j||: Wanda's masks do not depend on it."""

    def __init__(self, columns: int, device: torch.device | str = "cpu") -> None:
        self.sq = torch.zeros(columns, dtype=torch.float64, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.sq.add_(x.square().sum(0, dtype=torch.float64))
        self.n += x.shape[0]

    def reduce_across_ranks(self) -> None:
        self.sq.copy_(sum_across_ranks(self.sq))
        self.n = count_across_ranks(self.n)

    @property
    def norm(self) -> torch.Tensor:
        """||X_j||, the L2 norm of feature j over every calibration token (float32)."""
        return self.sq.sqrt().float()


Accumulator = HessianAccumulator | InputNormAccumulator | InputAmaxAccumulator


def inverse_hessian_factor(working_hessian: Callable[[], torch.Tensor], damp: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor U of (H + λI)⁻¹ (Uᵀ U = (H + λI)⁻¹), λ = damp · mean(diag H) (Eq. 4 and §4
    "Cholesky reformulation"), computed in the storage of ``working_hessian()``: a float32 copy of H that this
    function overwrites (called again when the factorization fails, with λ raised tenfold up to ``MAX_DAMP``;
    the damp that worked is returned so the caller can report it).

    With P the reversal permutation, L = chol(P H P) gives U = P L⁻¹ P: one Cholesky factorization and one
    triangular inverse, both in place, so beside the caller's H it takes one n x n matrix and n x
    ``SOLVE_ROWS`` temporaries (an 8B model's 14336-wide down_proj: 0.8 GB, where the textbook sequence of
    factor, identity, inverse and factor again took four such matrices and LAPACK's copies of them).
    U is returned as a column-major view (``U.mT`` is contiguous).
    """
    while True:
        work = working_hessian()
        reverse_storage_(work)  # P H P, in place: reversing a square matrix's storage flips rows and columns
        work.diagonal().add_(damp * torch.mean(torch.diag(work)).item())
        # P H P is symmetric, so its column-major view is the same matrix: LAPACK factors it in place there.
        L = work.mT
        if cholesky_in_place_(L):
            invert_upper_triangular_(work)  # work holds Lᵀ in row-major order; inverted, the view L is L⁻¹
            reverse_storage_(work)  # the view L is now P L⁻¹ P = U
            if all(torch.isfinite(rows).all() for rows in work.split(SOLVE_ROWS)):
                return L, damp
        del work, L
        if damp >= MAX_DAMP:
            raise RuntimeError(f"the Hessian is not positive definite even with dampening {damp}")
        damp = min(damp * 10, MAX_DAMP)


def cholesky_in_place_(L: torch.Tensor) -> bool:
    """The lower Cholesky factor of the symmetric ``L``, written over it; False when it is not positive definite."""
    if type(L) is torch.Tensor:
        info = torch.empty((), dtype=torch.int32, device=L.device)
        torch.linalg.cholesky_ex(L, out=(L, info))
        return info.item() == 0
    factor, info = torch.linalg.cholesky_ex(L)  # a tensor subclass (a wrapped device) may take no out=
    L.copy_(factor)
    return info.item() == 0


def reverse_storage_(matrix: torch.Tensor, chunk: int = 1 << 16) -> None:
    """Reverse a contiguous tensor's elements in place, ``chunk`` at a time (for a square matrix: P M P)."""
    flat = matrix.view(-1)
    n = flat.numel()
    for start in range(0, n // 2, chunk):
        stop = min(start + chunk, n // 2)
        head = flat[start:stop].clone()
        flat[start:stop] = flat[n - stop : n - start].flip(0)
        flat[n - stop : n - start] = head.flip(0)


def invert_upper_triangular_(R: torch.Tensor, rows: int = SOLVE_ROWS) -> None:
    """R⁻¹ in place for an upper-triangular, row-major R (zeros below the diagonal), a block of rows at a time
    from the bottom: with R = [[A, B], [0, D]] and D already inverted, the top rows become [A⁻¹, -A⁻¹ B D⁻¹]."""
    n = R.shape[0]
    for start in range(((n - 1) // rows) * rows, -1, -rows):
        stop = min(start + rows, n)
        block_inverse = torch.linalg.solve_triangular(
            R[start:stop, start:stop], torch.eye(stop - start, dtype=R.dtype, device=R.device), upper=True
        )
        if stop < n:
            R[start:stop, stop:] = -block_inverse @ (R[start:stop, stop:] @ R[stop:, stop:])
        R[start:stop, start:stop] = block_inverse


def collect_inputs(
    session: LayerSession,
    names: list[str],
    make: Callable[[int, torch.device], Accumulator],
    spread_experts: bool = False,
) -> dict:
    """One pass over the calibration batches feeding each of ``names``' inputs to an accumulator from ``make``.

    Linears fed the very same input tensor share one accumulator, so it is computed once. Where the session's
    batches are one rank's share (``session.ranks`` > 1), each accumulator is reduced across the ranks after
    the pass (``lmpress.calib.ranks``); with ``spread_experts``, the MoE experts' down projections are not: each
    rank holds those of the experts it solves, over every rank's tokens (``calib.expert_ranks``; the others are
    absent from the result and their owners are in ``session.hessian_owners``).
    """
    hessians: dict[str, Accumulator] = {}
    # Within a batch: input address -> (the input, kept alive so its address is not reused; its accumulator).
    by_input: dict[tuple, tuple[torch.Tensor, Accumulator]] = {}
    last_batch = [-1]
    blocks = experts_by_block(session.layer, names) if spread_experts and session.ranks > 1 else {}
    by_expert = {name for experts in blocks.values() for _, name in experts}
    block_inputs: dict[str, list[torch.Tensor]] = {block: [] for block in blocks}

    def on_input(name: str, batch: int, args: tuple, kwargs: dict) -> None:
        if name in block_inputs:  # an experts block's input: run through this rank's experts after the pass
            block_inputs[name].append(first_input(args, kwargs).detach().to("cpu", copy=True))
            return
        if batch != last_batch[0]:
            by_input.clear()
            last_batch[0] = batch
        x = args[0] if args else kwargs["input"]
        key = (x.data_ptr(), tuple(x.shape), x.dtype)
        shared = by_input[key][1] if key in by_input else None
        if name not in hessians:
            if shared is not None:
                hessians[name] = shared
                return
            hessians[name] = make(x.shape[-1], x.device)
        if shared is hessians[name]:
            return
        hessians[name].add(x)
        by_input[key] = (x, hessians[name])

    watched = [n for n in names if n not in by_expert] + list(blocks)
    session.forward(watched, on_input, skip_watched=session.independent_groups)
    if session.ranks > 1:  # each rank saw its share of the batches: every rank now holds the whole statistic
        for accumulator in {id(a): a for a in hessians.values()}.values():
            accumulator.reduce_across_ranks()
    for block, experts in blocks.items():
        owners = {name: session.expert_owners[name] for _, name in experts}
        session.hessian_owners.update(owners)
        inputs = block_inputs.pop(block)
        hessians |= owned_expert_hessians(session.layer, block, experts, owners, inputs, make, session.device)
    return hessians


def _cached(session: LayerSession, kind: str, names: list[str], make: Callable, spread_experts: bool = False) -> dict:
    key = (kind, tuple(names))
    if key not in session.statistics:
        session.statistics[key] = collect_inputs(session, names, make, spread_experts)
    return session.statistics[key]


def group_hessians(session: LayerSession, names: list[str]) -> dict[str, HessianAccumulator]:
    """H = 2XXᵀ of each of ``names`` (one group), computed once per group and shared by the pass's methods. Spread
    over ranks, a MoE expert's Hessian is held by the rank that solves it alone (``session.hessian_owners``)."""
    return _cached(session, "hessian", names, HessianAccumulator, spread_experts=True)


def group_input_norms(session: LayerSession, names: list[str]) -> dict[str, InputNormAccumulator]:
    """||X_j||² of each of ``names`` (one group), computed once per group and shared by the pass's methods."""
    return _cached(session, "input_norm", names, InputNormAccumulator)


def group_input_amax(session: LayerSession, names: list[str]) -> dict[str, InputAmaxAccumulator]:
    """max |X| of each of ``names`` (one group) over every calibration token, computed once per group."""
    return _cached(session, "input_amax", names, InputAmaxAccumulator)


@contextmanager
def column_loop_threads(n: int) -> Iterator[None]:
    """Run with ``n`` threads: the column loops of GPTQ and SparseGPT are thousands of tiny vector ops
    (one thread), GPTQ's group scale search one large tensor op (all threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
