"""Progress bars with ETA for long work (loading, each stage, each eval).

In a terminal: rich's live bars. Anywhere else (a log file, CI, a pipe), where live bars would only print once the
run ends: one plain line per step at a bounded rate (every 10% of a task, or at least every 30 s), with the elapsed
time and the ETA, written as it happens; while one step takes longer than 30 s (a layer of a large model), the
task's line is repeated every 30 s, so a log never looks stalled while work goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

T = TypeVar("T")
PLAIN_STEPS = 10  # a line every tenth of a task
PLAIN_EVERY_SECONDS = 30.0


def clock_text(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class PlainTask:
    """One task's progress as plain lines: ``description: 3/10 (30%) elapsed 0:00:12 eta 0:00:28``."""

    def __init__(self, console: Console, description: str, total: int | None, completed: int = 0) -> None:
        self.console, self.description, self.total = console, description, total
        self.done = self.start_done = completed
        self.began = self.last_time = time.monotonic()
        self.last_step = self.step()
        self.closed = False
        self.lock = threading.Lock()  # the heartbeat prints from another thread

    def advance(self, description: str | None = None) -> None:
        with self.lock:
            self.done += 1
            if description is not None:
                self.description = description
            now, step = time.monotonic(), self.step()
            if step > self.last_step or now - self.last_time >= PLAIN_EVERY_SECONDS:
                self.last_step = step
                self.print_line(now)

    def beat(self) -> None:
        """The task's line again if nothing was printed for ``PLAIN_EVERY_SECONDS`` and it is still open."""
        with self.lock:
            now = time.monotonic()
            if not self.closed and not self.finished and now - self.last_time >= PLAIN_EVERY_SECONDS:
                self.print_line(now)

    @property
    def finished(self) -> bool:
        return self.total is not None and self.done >= self.total

    def print_line(self, now: float) -> None:
        self.last_time = now
        self.console.print(self.line(now), highlight=False, soft_wrap=True)
        self.console.file.flush()

    def step(self) -> int:
        """How many tenths of the task are done (the last step: all of it)."""
        return self.done * PLAIN_STEPS // self.total if self.total else 0

    def line(self, now: float) -> str:
        elapsed = now - self.began
        if not self.total:  # an activity (no steps: "description: elapsed ..."), or steps of unknown number
            steps = f" {self.done}" if self.done else ""
            return f"{self.description}:{steps} elapsed {clock_text(elapsed)}"
        steps = self.done - self.start_done
        eta = elapsed / steps * (self.total - self.done) if steps else 0.0
        percent = 100 * self.done / self.total
        return (
            f"{self.description}: {self.done}/{self.total} ({percent:.0f}%) "
            f"elapsed {clock_text(elapsed)} eta {clock_text(eta)}"
        )


class Bars:
    """One rich Progress shared by a run; ``enabled=False`` for quiet library use and tests. Where its console is
    not a terminal, each task prints plain lines instead (``PlainTask``)."""

    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        console = console or Console(stderr=True)
        self.plain = enabled and not console.is_terminal
        self.current: PlainTask | None = None  # the plain task the heartbeat repeats (the latest: a run is sequential)
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            disable=not enabled or self.plain,
        )

    def __enter__(self) -> Bars:
        self._progress.start()
        if self.plain:
            self._stop.clear()
            self._heartbeat = threading.Thread(target=self._beat, name="lmpress-progress", daemon=True)
            self._heartbeat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._heartbeat is not None:
            self._stop.set()
            self._heartbeat.join()
            self._heartbeat = None
        self._progress.stop()

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, PLAIN_EVERY_SECONDS / 4)):
            task = self.current
            if task is not None:
                task.beat()

    def _plain_task(self, description: str, total: int | None, completed: int = 0) -> PlainTask:
        self.current = PlainTask(self._progress.console, description, total, completed)
        return self.current

    def track(self, items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
        if total is None and hasattr(items, "__len__"):
            total = len(items)  # type: ignore[arg-type]
        if self.plain:
            plain = self._plain_task(description, total)
            try:
                for item in items:
                    yield item
                    plain.advance()
            finally:
                plain.closed = True
            return
        task = self._progress.add_task(description, total=total)
        for item in items:
            yield item
            self._progress.advance(task)
        self._progress.refresh()

    def counter(self, description: str, total: int, completed: int = 0) -> Callable[[str], None]:
        """A bar advanced by hand: each call moves it one step and replaces its description
        (e.g. with the latest loss and tokens/s)."""
        if self.plain:
            return self._plain_task(description, total, completed).advance
        task = self._progress.add_task(description, total=total, completed=completed)

        def advance(new_description: str) -> None:
            self._progress.update(task, advance=1, description=new_description)

        return advance

    @contextmanager
    def activity(self, description: str) -> Iterator[None]:
        """Work without steps (an export, reading one back, the runtime check): in a terminal an open-ended bar,
        elsewhere its line every 30 s while it lasts (nothing if it ends sooner)."""
        if self.plain:
            task = self._plain_task(description, None)
            try:
                yield
            finally:
                task.closed = True
            return
        bar = self._progress.add_task(description, total=None)
        try:
            yield
        finally:
            self._progress.remove_task(bar)

    def log(self, message: str) -> None:
        if self.enabled:
            self._progress.console.print(message)


QUIET = Bars(enabled=False)
