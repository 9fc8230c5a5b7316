"""Calibration activations that the layer-wise engine keeps between passes, one slab per kind.

Per calibration batch the engine keeps a layer's input, a finished block's output
or a linear's input. :class:`BatchStore` puts the batches of one kind in one
float16 slab, allocated once for all of them: a slab this size is its own memory
mapping, handed back whole to the kernel when the store is dropped. Kept one
tensor per batch instead, each batch's copy is carved out of the heap between
that batch's temporaries, so the next batch's temporaries no longer fit there and
the heap grows by about one temporary per batch (measured at the end of SmolLM2's
down_proj pass: 296 MB of free heap pages held, which a peak RSS counts).

A batch whose values float16 cannot hold is kept apart in float32, and so is
anything that does not line up with the slab (another shape, integer tensors).

With a :class:`Spill`, slabs beyond a budget of RAM live in files instead: mapped shared, so the kernel writes
their pages out and reads them back as the passes need them, and unlinked as soon as they are mapped, so nothing
is left on disk once the store is dropped, even after a kill.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmpress.errors import LmpressInputError

FLOAT16_LIMIT = 60000.0


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` (a tensor, or tuples/lists/dicts of them) with ``fn`` applied to every tensor."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple | list):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def fits_float16(x: torch.Tensor) -> bool:
    if x.dtype == torch.float16 or not x.numel():
        return True
    low, high = torch.aminmax(x)
    return max(-low.item(), high.item()) <= FLOAT16_LIMIT


def compact(x: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``x`` in float16 when that holds its range, else float32 (non-float tensors as they are)."""
    x = x.detach()
    if not x.is_floating_point():
        return x.cpu()
    return x.to("cpu", torch.float16 if fits_float16(x) else torch.float32, copy=True)


@dataclass
class Spill:
    """Calibration activations beyond ``ram_bytes`` (the slabs alive at once) go to files in ``directory``."""

    directory: Path
    ram_bytes: int
    held: int = 0  # bytes of the slabs in RAM now
    spilled: int = 0  # bytes of the slabs in files now

    def check_room(self, needed: int) -> None:
        """Refuse, before any work, a directory that cannot take what may spill (``needed``: every slab's bytes)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.directory).free
        if needed - self.ram_bytes > free:
            raise LmpressInputError(
                f"data.spill_dir {self.directory} has {free / 2**30:.1f} GiB free and the calibration activations "
                f"beyond data.activations_ram_gb need up to {(needed - self.ram_bytes) / 2**30:.1f} GiB: choose a "
                "directory with more room or raise activations_ram_gb"
            )

    def slab(self, shape: Sequence[int]) -> torch.Tensor:
        """An uninitialised float16 tensor of ``shape``: in RAM while the budget allows, else in a file."""
        size = math.prod(shape) * 2
        if self.held + size <= self.ram_bytes:
            slab = torch.empty(*shape, dtype=torch.float16)
            self.held += size
            weakref.finalize(slab, self._release, "held", size)
            return slab
        fd, path = tempfile.mkstemp(prefix="activations-", suffix=".f16", dir=self.directory)
        os.close(fd)
        try:
            slab = torch.from_file(path, shared=True, size=math.prod(shape), dtype=torch.float16).view(*shape)
        finally:
            os.unlink(path)  # the mapping keeps the pages; the disk space goes with the last reference
        self.spilled += size
        weakref.finalize(slab, self._release, "spilled", size)
        return slab

    def _release(self, kind: str, size: int) -> None:
        setattr(self, kind, getattr(self, kind) - size)


class BatchStore:
    """One value per calibration batch (a tensor or a tuple/list/dict of them), indexed by batch.

    ``rows`` are the samples in each batch; a tensor whose first dimension is its
    batch's row count goes into the slab of its position in the value.
    ``len(store)`` counts the batches stored so far.
    """

    def __init__(self, rows: Sequence[int], spill: Spill | None = None) -> None:
        self.rows = list(rows)
        self.spill = spill
        self.offsets = [0, *itertools.accumulate(self.rows)]
        self._slabs: dict[int, torch.Tensor] = {}  # tensor position within a value -> slab over all batches
        self._values: dict[int, Any] = {}

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], spill: Spill | None = None) -> BatchStore:
        store = cls([t.shape[0] for t in tensors], spill)
        for i, t in enumerate(tensors):
            store[i] = t
        return store

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, i: int) -> Any:
        return self._values[i]

    def __iter__(self) -> Iterator[Any]:
        return (self._values[i] for i in range(len(self.rows)) if i in self._values)

    def __setitem__(self, i: int, value: Any) -> None:
        position = itertools.count()
        self._values[i] = map_tensors(value, lambda t: self._keep(i, next(position), t))

    def _keep(self, i: int, position: int, x: torch.Tensor) -> torch.Tensor:
        x = x.detach()
        if not (x.is_floating_point() and x.dim() and x.shape[0] == self.rows[i] and fits_float16(x)):
            return compact(x)
        slab = self._slabs.get(position)
        if slab is None:
            shape = (self.offsets[-1], *x.shape[1:])
            slab = self.spill.slab(shape) if self.spill else torch.empty(*shape, dtype=torch.float16)
            self._slabs[position] = slab
        if slab.shape[1:] != x.shape[1:]:
            return compact(x)
        view = slab[self.offsets[i] : self.offsets[i + 1]]
        view.copy_(x)
        return view


@dataclass
class LayerInputs:
    """What one decoder layer receives, per calibration batch."""

    hidden: BatchStore
    kwargs: list[dict[str, Any]]
    # Where layers differ in what they receive (sliding-window layers' masks, Gemma 3's local rope): the keyword
    # arguments of each layer type (``config.layer_types``), per batch; ``kwargs`` is then the current layer's.
    by_kind: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
