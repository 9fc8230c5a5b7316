"""One recipe run across the processes a launcher starts (``accelerate launch``, ``torchrun``).

Every process runs the recipe's stages up to its last stage that uses them all: a ``distill`` stage (DDP) or a
stage of the layer-wise calibration engine (each process replays its share of the calibration samples and the
statistics are summed across them: ``lmpress.calib.ranks``). Stages before it are the same deterministic work
in each, so every process holds the same model when that stage starts. Only the main process writes the output
directory, exports and scores; the others keep their own stage state in a scratch directory beside ``--out``
(kept for ``--resume`` after a kill, removed when they finish) and stop after that stage. A recipe with neither
gives the other processes nothing to do.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from lmpress.errors import LmpressStopped

# The main process scores the baseline before the stages while the others go straight to them, so
# they can wait that long at the first collective of training (torch's default timeout is 10 minutes).
FIRST_COLLECTIVE_TIMEOUT = timedelta(hours=4)


@dataclass(frozen=True)
class Processes:
    """This process's place among the launched ones; one process (rank 0 of 1) when not launched."""

    rank: int = 0
    world: int = 1
    device: torch.device | None = None  # the device this process computes on, where a launcher assigned one

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @contextmanager
    def main_first(self) -> Iterator[None]:
        """The main process runs the block first (e.g. writes a cache), then the others (which read it)."""
        if self.world == 1:
            yield
            return
        from accelerate import PartialState

        with PartialState().main_process_first():
            yield

    def scratch_dir(self, out: Path) -> Path:
        """Where a non-main process keeps its stage state: beside ``out``, never inside the main's."""
        return rank_partial_dir(out.parent / f".{out.name}.partial", self.rank)


def rank_partial_dir(main_partial: Path, rank: int) -> Path:
    """Where launched process ``rank`` keeps its stage state, given the main process's partial directory."""
    return main_partial if rank == 0 else main_partial.with_name(f"{main_partial.name}-rank{rank}")


def launched_processes(device: torch.device) -> Processes:
    """The processes a launcher started, as it described them (``WORLD_SIZE``, ``RANK``, ... read by
    accelerate); the process group is joined here, on ``device``'s kind (NCCL on GPUs, gloo on CPUs)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Processes()
    from accelerate import PartialState

    state = PartialState(cpu=device.type == "cpu", timeout=FIRST_COLLECTIVE_TIMEOUT)
    return Processes(state.process_index, state.num_processes, state.device)


def stop_when_the_launcher_does(processes: Processes) -> None:
    """A launched process that its launcher ends (torchrun sends SIGTERM to the others when one dies) says so in
    one line (:class:`LmpressStopped`) instead of vanishing; a second SIGTERM ends it at once."""
    if processes.world == 1:
        return

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise LmpressStopped(
            f"process {processes.rank} of {processes.world} was stopped by its launcher (another launched process "
            "ended first: the launcher's report names it); what it finished is saved: run the same launch with "
            "--resume"
        )

    signal.signal(signal.SIGTERM, stop)


def remove_departed_states(main_partial: Path, world: int) -> None:
    """Remove the state directories of the processes a resumed launch no longer has (it had more before)."""
    for path in main_partial.parent.glob(f"{main_partial.name}-rank*"):
        rank = path.name.rpartition("-rank")[2]
        if rank.isdigit() and int(rank) >= world:
            shutil.rmtree(path, ignore_errors=True)


def fsdp_requested() -> bool:
    """Whether the launcher asked for FSDP: ``accelerate launch --use_fsdp`` (or a config file naming FSDP)
    tells every process so in its environment, which accelerate reads when it builds its state."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def last_shared_stage(stages: Sequence[Any]) -> int:
    """Index of the last stage the launched processes run together (-1: none): one that trains across them, or
    one of the layer-wise calibration engine."""
    shared = (i for i, stage in enumerate(stages) if stage.trains_across_processes or stage.calibrates_layerwise)
    return max(shared, default=-1)
