"""Where a resumed layer-wise pass starts, and the inputs it starts from, whatever processes saved them.

Each launched process saves its own state (``calib.state``): the main process in the run's partial directory,
process q in ``.<out>.partial-rank<q>`` beside it (``distributed.rank_partial_dir``). A pass that spreads its
batches saves each process's share of the next layer's inputs; one that does not saves every batch in every
process. Resuming with as many processes reads each process's own state. Resuming with another number reads the
states of all the processes that saved it (one machine, or a filesystem they share): every process takes the
batches of its new share from whichever old state holds them, the finished layers from the main process's state,
and starts at the first layer some old process had not finished. Processes keep the inputs of their last two
finished layers when launched (``LayerState.keep_inputs``), since one may have saved a layer more than another
when the launch stopped. A pass whose processes share each batch's samples (learned rounding) saved each process's
part of every batch: a resume with another number of processes joins the parts and cuts them anew.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from lmpress.calib.activations import BatchStore, LayerInputs, Spill
from lmpress.calib.ranks import rank_batches
from lmpress.calib.state import LayerState
from lmpress.distributed import rank_partial_dir
from lmpress.errors import LmpressInputError


def rank_state_dir(main_dir: Path, rank: int) -> Path:
    """Process ``rank``'s state directory for the stage whose main-process state directory is ``main_dir``
    (``<partial>/state/<stage>``)."""
    if rank == 0:
        return main_dir
    return rank_partial_dir(main_dir.parent.parent, rank) / "state" / main_dir.name


@dataclass(frozen=True)
class SavedStates:
    """The states a resumed pass reads: those of the ``processes`` that saved them (this process's own state
    alone when the main process's is not visible here: another machine)."""

    main_dir: Path
    fingerprint: str
    processes: int
    rank: int  # this process's rank now
    world: int  # processes now

    @classmethod
    def find(cls, own: LayerState, main_dir: Path, rank: int, world: int) -> SavedStates:
        main = LayerState(main_dir, own.fingerprint).progress()
        processes = main.get("processes", 1) if main else world
        return cls(main_dir, own.fingerprint, processes, rank, world)

    @property
    def regrouped(self) -> bool:
        """Whether the state was saved by another number of processes than resumes it."""
        return self.processes != self.world

    def saved_by(self, q: int) -> LayerState:
        return LayerState(rank_state_dir(self.main_dir, q), self.fingerprint, self.processes)

    def done_layers(self, own: LayerState) -> int:
        """The layers this process can take as finished (the engine then starts every process at the least)."""
        if not self.regrouped:
            return own.done_layers()
        done = []
        for q in range(self.processes):
            state = self.saved_by(q)
            if state.progress() is None:
                raise LmpressInputError(
                    f"cannot resume with {self.world} process(es) from a pass calibrated across {self.processes}: "
                    f"process {q}'s state ({state.dir}) is not here; resume on the machine (or shared filesystem) "
                    f"that holds every process's state, with {self.processes} processes, or without --resume"
                )
            done.append(state.done_layers())
        return min(done)

    def take_finished_layers(self, own: LayerState, done: int) -> None:
        """Put the main process's files of the ``done`` finished layers in ``own``'s directory where they are
        missing (a process that did not exist when they were saved): hard links where the filesystem allows."""
        main = self.saved_by(0)
        if own.dir == main.dir:
            return
        for index in range(done):
            name = f"layer_{index:05d}.safetensors"
            if not (own.dir / name).exists():
                tmp = own.dir / f".{name}.tmp"
                try:
                    os.link(main.dir / name, tmp)
                except OSError:
                    shutil.copyfile(main.dir / name, tmp)
                os.replace(tmp, own.dir / name)

    def load_inputs(
        self, done: int, n_batches: int, mine: range, kwargs: list[dict], spill: Spill | None = None
    ) -> tuple[LayerInputs, dict[str, torch.Tensor]]:
        """Layer ``done``'s inputs for global batches ``mine`` (this process's share, or every batch), each from
        an old state that holds it (this process's own first), and the carried tensors saved with them."""
        order = sorted(range(self.processes), key=lambda q: q != self.rank)
        hidden: dict[int, torch.Tensor] = {}
        carried: dict[str, torch.Tensor] | None = None
        for q in order:
            path = self.saved_by(q).dir / f"inputs_{done:05d}.safetensors"
            if len(hidden) == len(mine) or not path.exists():
                continue
            with safe_open(path, "pt") as f:
                keys = list(f.keys())
                count = sum(k.startswith("h.") for k in keys)
                held = range(n_batches) if count == n_batches else rank_batches(n_batches, q, self.processes)
                if len(held) != count:
                    raise LmpressInputError(f"cannot resume from {path}: it holds {count} batches, not {len(held)}")
                for b in mine:
                    if b in held and b not in hidden:
                        hidden[b] = f.get_tensor(f"h.{b - held.start}")
                if carried is None:
                    carried = {k.removeprefix("m."): f.get_tensor(k) for k in keys if k.startswith("m.")}
        missing = [b for b in mine if b not in hidden]
        if missing:
            raise LmpressInputError(
                f"cannot resume: the saved inputs of layer {done} for calibration batch(es) {missing[:4]} are not "
                f"here (kept by the {self.processes} process(es) that saved the state); resume where every "
                "process's state is, or run without --resume"
            )
        return LayerInputs(BatchStore.of([hidden[b] for b in mine], spill), kwargs), carried or {}

    def load_rows(
        self, done: int, n_batches: int, kwargs: list[dict], spill: Spill | None = None
    ) -> tuple[LayerInputs, dict[str, torch.Tensor]]:
        """``load_inputs`` for a pass whose processes share each batch's samples (``spreads_rows``): each old
        process saved its part of every batch, and of each carried tensor (its rows first); a batch's parts joined in
        process order are the batch, cut anew into this process's part (``rank_batches`` over its samples)."""
        paths = [self.saved_by(q).dir / f"inputs_{done:05d}.safetensors" for q in range(self.processes)]
        missing = [str(path) for path in paths if not path.exists()]
        if missing:
            raise LmpressInputError(
                f"cannot resume: the saved inputs of layer {done} ({missing[0]}) are not here (each of the "
                f"{self.processes} process(es) that saved the state kept its part of every batch); resume where every "
                "process's state is, or run without --resume"
            )

        def mine(parts: list[torch.Tensor]) -> torch.Tensor:
            whole = torch.cat(parts)
            return whole[rank_batches(len(whole), self.rank, self.world)].clone()

        with contextlib.ExitStack() as stack:
            files = [stack.enter_context(safe_open(path, "pt")) for path in paths]
            hidden = [mine([f.get_tensor(f"h.{b}") for f in files]) for b in range(n_batches)]
            keys = [k for k in files[0].keys() if k.startswith("m.")]
            carried = {k.removeprefix("m."): mine([f.get_tensor(k) for f in files]) for k in keys}
        return LayerInputs(BatchStore.of(hidden, spill), kwargs), carried
