"""Calibration spread over launched processes (``torchrun``, ``accelerate launch``): data-parallel layer passes.

Each rank replays its own contiguous share of the calibration batches through every layer and keeps only its
share's activations; the statistics a pass gathers (Hessians, input norms, maxima) are summed across ranks in
float64 at the end of each statistics pass, so every rank holds the same statistic; each linear's solve (GPTQ)
runs on one rank, chosen by cost, and its result is broadcast, so every rank applies the same weights and
computes its share's outputs for the next layer with them. gloo on CPUs, NCCL on GPUs: torch.distributed's
collectives, whichever group the launcher's processes joined (``lmpress.distributed``).

A pass spreads only when every method in it reduces what it gathers (``CalibrationMethod.reduces_across_ranks``);
any other pass runs in full on every rank, the same deterministic work, so the ranks stay in step. A pass whose
methods step through the batches one at a time (learned rounding: one batch per optimisation step) shares each
batch's rows instead (``CalibrationMethod.spreads_rows``): every rank holds its part of every batch, so each step's
forward and backward pass is split across the ranks and its gradient summed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from lmpress.errors import LmpressInputError, LmpressStopped

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def calibration_ranks() -> tuple[int, int]:
    """(this process's rank, the number of processes) of the process group; (0, 1) when there is none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_batches(n_batches: int, rank: int, world: int) -> range:
    """The contiguous batches rank ``rank`` of ``world`` replays (counts differ by at most one)."""
    base, extra = divmod(n_batches, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def check_shareable(n_samples: int, batch_size: int, world: int, by_rows: bool = False) -> None:
    """Refuse a calibration set with fewer batches than there are processes to share them (``by_rows``: a batch
    with fewer samples than there are processes to share its rows)."""
    if by_rows:
        smallest = n_samples % batch_size or min(batch_size, n_samples)
        if smallest < world:
            raise LmpressInputError(
                f"{n_samples} calibration samples in batches of {batch_size} leave a batch of {smallest}, fewer "
                f"samples than the {world} launched processes that share each batch's samples; make data.samples "
                "a multiple of batch_size, raise batch_size, or launch fewer processes"
            )
        return
    n_batches = math.ceil(n_samples / batch_size)
    if n_batches < world:
        raise LmpressInputError(
            f"{n_samples} calibration samples in batches of {batch_size} make {n_batches} batches, fewer than the "
            f"{world} launched processes that share them; raise data.samples or launch fewer processes"
        )


def rank_samples(calibration: torch.Tensor, batch_size: int, rank: int, world: int) -> torch.Tensor:
    """The calibration samples (rows) of rank ``rank``'s batches."""
    check_shareable(len(calibration), batch_size, world)
    batches = rank_batches(math.ceil(len(calibration) / batch_size), rank, world)
    return calibration[batches.start * batch_size : batches.stop * batch_size]


def rank_batch_rows(calibration: torch.Tensor, batch_size: int, rank: int, world: int) -> list[torch.Tensor]:
    """Rank ``rank``'s part of every batch: its contiguous share of each batch's samples (``spreads_rows``)."""
    check_shareable(len(calibration), batch_size, world, by_rows=True)
    return [batch[rank_batches(len(batch), rank, world)] for batch in calibration.split(batch_size)]


def collective(function: Callable[..., T]) -> Callable[..., T]:
    """``function`` (which calls torch.distributed's collectives) with a collective that fails because another
    process is gone (gloo: "Connection reset by peer"; NCCL: a timeout or a closed communicator) reported as
    :class:`LmpressStopped` in one line: what failed and that ``--resume`` continues from the saved layers."""

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> T:
        try:
            return function(*args, **kwargs)
        except RuntimeError as e:
            rank, world = calibration_ranks()
            why = " ".join(str(e).split())
            why = why.split("] ", 1)[-1][:160]  # gloo's and NCCL's messages open with a source path in brackets
            raise LmpressStopped(
                f"process {rank} of {world}: a collective of the calibration failed ({why}): another launched "
                "process has stopped (the launcher's report names it); the finished layers are saved: run the same "
                "launch with --resume"
            ) from e

    return guarded


@collective
def _all_reduce(tensor: torch.Tensor, op: Any) -> None:
    import torch.distributed as dist

    dist.all_reduce(tensor, op=op)


@collective
def _broadcast_objects(box: list, src: int) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list(box, src=src)


def broadcast_object(value: T | None, src: int) -> T:
    """Rank ``src``'s ``value`` (picklable, its tensors on the CPU), on every rank."""
    box = [value]
    _broadcast_objects(box, src)
    return box[0]


@collective
def all_gather_objects(value: T) -> list[T]:
    """Every rank's ``value`` (picklable, its tensors on the CPU), in rank order."""
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, value)
    return parts


def check_same_run(digest: str) -> None:
    """Refuse (one line, exit 2, in every process) a launch whose processes were given different recipes, data or
    models: ``digest`` hashes this process's (the stages' fingerprint); every process compares all of them."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    digests = all_gather_objects(digest)
    differ = [rank for rank, other in enumerate(digests) if other != digests[0]]
    if differ:
        raise LmpressInputError(
            f"launched process(es) {', '.join(map(str, differ))} of {len(digests)} were given another recipe, "
            "calibration data or model than process 0 (their hashes differ): launch every process with the same "
            "recipe, --set options and model"
        )


def sum_across_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of ``tensor`` over every rank, computed in float64, in ``tensor``'s dtype."""
    import torch.distributed as dist

    total = tensor.double()
    _all_reduce(total, dist.ReduceOp.SUM)
    return total.to(tensor.dtype)


def add_across_ranks_(tensor: torch.Tensor) -> None:
    """``tensor`` replaced in place by its elementwise sum over every rank, in its own dtype. Every rank receives
    the same bits: gloo's and NCCL's ring algorithms reduce each element along one path and send that result to
    every rank (and the sum of two processes' values does not depend on their order)."""
    import torch.distributed as dist

    _all_reduce(tensor, dist.ReduceOp.SUM)


def max_across_ranks_(tensor: torch.Tensor) -> None:
    """``tensor`` replaced in place by its elementwise maximum over every rank."""
    import torch.distributed as dist

    _all_reduce(tensor, dist.ReduceOp.MAX)


def min_across_ranks(n: int) -> int:
    """The smallest of an integer over every rank."""
    import torch.distributed as dist

    value = torch.tensor([n], dtype=torch.int64, device=_collective_device())
    _all_reduce(value, dist.ReduceOp.MIN)
    return int(value.item())


def _collective_device() -> torch.device:
    """Where the group's collectives take their tensors: the current GPU under NCCL, else the CPU."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def count_across_ranks(n: int) -> int:
    """The sum of an integer count over every rank."""
    return int(sum_across_ranks(torch.tensor([n], dtype=torch.int64, device=_collective_device())).item())


def owners_by_cost(
    names: Sequence[K], cost: Callable[[K], float], world: int, fixed: Mapping[K, int] | None = None
) -> dict[K, int]:
    """Each of ``names`` assigned to a rank: those in ``fixed`` to theirs, the rest the costliest first, each to the
    least loaded rank (ties: the lowest rank), the same answer on every rank."""
    fixed = {name: rank for name, rank in (fixed or {}).items() if name in names}
    load = [0.0] * world
    for name, rank in fixed.items():
        load[rank] += cost(name)
    owners = dict(fixed)
    for name in sorted((n for n in names if n not in fixed), key=lambda n: (-cost(n), names.index(n))):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += cost(name)
    return owners


def column_solve_cost(weight: torch.Tensor) -> float:
    """What a GPTQ or SparseGPT solve of ``weight`` costs, relatively: the column loop (rows x columns) and the
    factorization of the columns x columns Hessian."""
    rows, columns = weight.shape
    return rows * columns + columns**3 / 64


def solve_across_ranks(
    names: Sequence[K],
    cost: Callable[[K], float],
    solve: Callable[[K], T],
    world: int,
    fixed: Mapping[K, int] | None = None,
) -> dict[K, T]:
    """``solve(name)`` for each of ``names``, each on one rank (``owners_by_cost``; ``fixed``: the rank that holds
    a name's statistic alone), every result broadcast to every rank in ``names``' order. With ``world`` 1: every
    solve here, in order."""
    if world == 1:
        return {name: solve(name) for name in names}
    import torch.distributed as dist

    rank = dist.get_rank()
    owners = owners_by_cost(names, cost, world, fixed)
    mine = {name: solve(name) for name in names if owners[name] == rank}
    results = {}
    for name in names:
        # on the CPU: a tensor is unpickled where it was saved, which would be another rank's GPU
        results[name] = broadcast_object(_tensors_on_cpu(mine.get(name)), owners[name])
    return results


def _tensors_on_cpu(value: T) -> T:
    """A dataclass result (a quantized weight) or a tuple of them with every tensor field moved to the CPU."""
    if isinstance(value, tuple):
        return tuple(_tensors_on_cpu(v) for v in value)  # type: ignore[return-value]
    if isinstance(value, torch.Tensor):
        return value.cpu()  # type: ignore[return-value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        moved = {
            f.name: getattr(value, f.name).cpu()
            for f in dataclasses.fields(value)
            if f.init and isinstance(getattr(value, f.name), torch.Tensor)
        }
        return dataclasses.replace(value, **moved)
    return value
