"""A mixture-of-experts block's Hessians spread over launched processes by expert, not summed in every process.

A spread pass (``lmpress.calib.ranks``) gives each process a share of the calibration batches and sums each
statistic across the processes, so every process ends up holding every Hessian. For the down projections of a
MoE block's experts, whose inputs differ by expert (every expert runs on every token while calibrated:
``calib.moe``'s ``calibrate_all``), that is one ``I x I`` Hessian per expert in every process: 256 of them for each
DeepSeek-V3 layer, 4 GiB (float32, or the float64 sums of their upper triangles). Here the experts block is watched
as one module instead: each process records the block's input on its own batches, every batch is then broadcast from the
process that holds it in the one process's batch order, and each process runs only the experts whose solves it owns
on it, feeding their down projections' inputs to their Hessians. Each process holds its experts' Hessians alone, the
experts' work is split by expert instead of by token, and each Hessian adds the same float32 products in the same
order as one process does: the same Hessian, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import nn

from lmpress.calib.hooks import StopForward
from lmpress.calib.moe import UnfusedExperts, expert_of
from lmpress.calib.ranks import (
    broadcast_object,
    calibration_ranks,
    column_solve_cost,
    count_across_ranks,
    owners_by_cost,
    rank_batches,
)

T = TypeVar("T")


def experts_by_block(layer: nn.Module, names: Iterable[str]) -> dict[str, list[tuple[int, str]]]:
    """The linears of ``names`` that read their own expert's intermediate (``{block}.{e}.down_proj`` of an
    :class:`UnfusedExperts` block), by block: ``{block: [(e, name), ...]}``."""
    found: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        parsed = expert_of(name)
        if parsed is None or parsed[2] != "down_proj":
            continue
        block, index, _ = parsed
        if isinstance(layer.get_submodule(block), UnfusedExperts):
            found.setdefault(block, []).append((index, name))
    return found


def expert_linear_owners(layer: nn.Module, names: Iterable[str], world: int) -> dict[str, int]:
    """The process that solves each of ``names`` that belongs to an expert of an :class:`UnfusedExperts` block
    (``{block}.{e}.gate_proj``...): one process for all of an expert's linears, the experts shared out by the
    cost of their solves (``ranks.owners_by_cost``), the same answer whichever of them ``names`` holds. The owner
    holds the expert's down projection Hessian and its float stand-ins; the others run it from its packed codes
    (``LayerSession.apply``). Read while every one of them is still a float linear (``LayerSession`` does so
    when it begins the layer)."""
    wanted: dict[str, list[tuple[int, str]]] = {}  # block -> (e, name) of its experts' linears among names
    for name in names:
        parsed = expert_of(name)
        if parsed is not None and isinstance(layer.get_submodule(parsed[0]), UnfusedExperts):
            wanted.setdefault(parsed[0], []).append((parsed[1], name))
    owners = {}
    for block, members in wanted.items():
        experts = list(range(len(layer.get_submodule(block))))
        linears = {
            e: [m for m in layer.get_submodule(f"{block}.{e}").children() if isinstance(m, nn.Linear)] for e in experts
        }
        cost = {e: sum(column_solve_cost(m.weight) for m in linears[e]) for e in experts}
        by_expert = owners_by_cost(experts, cost.__getitem__, world)
        owners |= {name: by_expert[e] for e, name in members}
    return owners


def down_projection_input(expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What ``expert``'s down projection reads when the expert runs on ``x`` (its own forward, stopped there)."""
    seen: list[torch.Tensor] = []

    def grab(module: nn.Module, args: tuple) -> None:
        seen.append(args[0])
        raise StopForward

    handle = expert.down_proj.register_forward_pre_hook(grab)
    try:
        expert(x)
    except StopForward:
        pass
    finally:
        handle.remove()
    return seen[0]


@torch.no_grad()
def owned_expert_hessians(
    layer: nn.Module,
    block: str,
    experts: list[tuple[int, str]],
    owners: dict[str, int],
    inputs: list[torch.Tensor],
    make: Callable[[int, torch.device], T],
    device: torch.device,
) -> dict[str, T]:
    """The Hessians (accumulators from ``make(columns, device)``) of this process's experts of ``block``
    (``owners``) over every process's tokens: ``inputs`` is the block's input on each of this process's batches (its
    contiguous share, ``ranks.rank_batches``); each batch of every process is broadcast in turn and run through this
    process's experts."""
    rank, world = calibration_ranks()
    module = layer.get_submodule(block)
    mine = [(e, name) for e, name in experts if owners[name] == rank]
    hessians = {name: make(module[e].down_proj.in_features, device) for e, name in mine}
    n_batches = count_across_ranks(len(inputs))
    for source in range(world):
        share = rank_batches(n_batches, source, world)
        for i in range(len(share)):
            x = broadcast_object(inputs[i] if source == rank else None, source).to(device)
            for e, name in mine:
                hessians[name].add(down_projection_input(module[e], x))
    return hessians
