"""Inputs of chosen submodules of a decoder block, recorded on calibration batches and replayed.

Searches that score candidates on a block's output (AWQ's scales and clipping,
SmoothQuant's alpha) record what the block's linears and attention/MLP modules
receive, then rerun those modules on the recording for each candidate.

Where the layer's calibration batches are shared by launched processes, each records the search batches in its
share and every process then holds the whole recording (:func:`record_search_batches`), so each can score any
candidate exactly as one process would; the candidates are then shared out (``ranks.solve_across_ranks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmpress.calib.activations import map_tensors
from lmpress.calib.ranks import broadcast_object, calibration_ranks, count_across_ranks, rank_batches

if TYPE_CHECKING:
    from lmpress.calib.session import LayerSession


def common_parent(names: list[str]) -> str:
    """The module the linears ``names`` belong to (the linear itself when there is one)."""
    if len(names) == 1:
        return names[0]
    parts = [n.split(".")[:-1] for n in names]
    shared = []
    for level in zip(*parts, strict=False):
        if len(set(level)) > 1:
            break
        shared.append(level[0])
    return ".".join(shared)


class RecordedInputs:
    """Inputs of the watched modules on the search batches, stored once per distinct tensor."""

    def __init__(self) -> None:
        self.inputs: dict[str, list[torch.Tensor]] = {}
        self.kwargs: dict[str, list[dict]] = {}
        self.as_keyword: dict[str, bool] = {}
        self._batch = -1
        # Within a batch: input tensor's address -> (the tensor, kept alive so the address is not reused; its copy).
        self._by_ptr: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, name: str, batch: int, args: tuple, kwargs: dict) -> None:
        if batch != self._batch:
            self._batch, self._by_ptr = batch, {}
        x = args[0] if args else kwargs["hidden_states"]
        _, stored = self._by_ptr.setdefault(x.data_ptr(), (x, x.detach().float().clone()))
        self.inputs.setdefault(name, []).append(stored)
        self.kwargs.setdefault(name, []).append({k: v for k, v in kwargs.items() if k != "hidden_states"})
        self.as_keyword[name] = not args

    def run(self, module: nn.Module, name: str) -> list[torch.Tensor]:
        """``module`` on the recorded inputs (kept in float32), cast to the module's dtype (a half model)."""
        dtype = next(module.parameters()).dtype
        outputs = []
        for x, kwargs in zip(self.inputs[name], self.kwargs[name], strict=True):
            x = x.to(dtype)
            out = module(hidden_states=x, **kwargs) if self.as_keyword[name] else module(x, **kwargs)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return outputs

    def divide(self, names: list[str], s: torch.Tensor) -> None:
        """After folding ``s``: the recorded inputs of ``names`` are what the scaled source now produces."""
        unique = {id(t): t for name in names for t in self.inputs.get(name, [])}
        for t in unique.values():
            t.div_(s)

    def tokens(self, name: str, limit: int) -> torch.Tensor:
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in self.inputs[name]])
        step = max(1, x.shape[0] // limit)
        return x[::step][:limit]


def record_search_batches(session: LayerSession, watch: list[str], n_batches: int) -> RecordedInputs:
    """The inputs of ``watch`` on the first ``n_batches`` calibration batches of the whole set. With the batches
    shared by launched processes (``session.ranks`` > 1), each records the search batches in its share and every
    process receives every recording, in batch order: the recording one process would make."""
    recorded = RecordedInputs()
    if session.ranks == 1:
        session.forward(watch, recorded, limit=n_batches)
        return recorded
    rank, world = calibration_ranks()
    total = count_across_ranks(len(session.inputs.hidden))
    shares = [rank_batches(total, q, world) for q in range(world)]
    counts = [max(0, min(n_batches, share.stop) - share.start) for share in shares]
    if counts[rank]:
        session.forward(watch, recorded, limit=counts[rank])
    merged = RecordedInputs()
    for q in (q for q in range(world) if counts[q]):  # each recording process sends its part to the others
        own = (recorded.inputs, recorded.kwargs, recorded.as_keyword)
        part = broadcast_object(_moved(*own, device="cpu") if q == rank else None, q)
        inputs, kwargs, as_keyword = own if q == rank else _moved(*part, device=session.device)
        del part
        for name in inputs:
            merged.inputs.setdefault(name, []).extend(inputs[name])
            merged.kwargs.setdefault(name, []).extend(kwargs[name])
        merged.as_keyword.update(as_keyword)
    return merged


def _moved(*values: Any, device: torch.device | str) -> tuple:
    """``values`` with every tensor on ``device``; a tensor held in several places stays one tensor (the
    recording stores an input shared by several watched modules once, and ``divide`` scales it once)."""
    done: dict[int, torch.Tensor] = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            done[id(t)] = t.to(device)
        return done[id(t)]

    return tuple(map_tensors(v, move) for v in values)
