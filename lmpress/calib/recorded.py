"""Inputs of chosen submodules of a decoder block, recorded on calibration batches and replayed.

Searches that score candidates on a block's output (AWQ's scales and clipping,
SmoothQuant's alpha) record what the block's linears and attention/MLP modules
receive, then rerun those modules on the recording for each candidate.
"""

from __future__ import annotations

import torch
from torch import nn


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
