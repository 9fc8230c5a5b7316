"""Progress bars with ETA for long work (loading, each stage, each eval)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
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


class Bars:
    """One rich Progress shared by a run; ``enabled=False`` for quiet library use and tests."""

    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console or Console(stderr=True),
            disable=not enabled,
        )

    def __enter__(self) -> Bars:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def track(self, items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
        if total is None and hasattr(items, "__len__"):
            total = len(items)  # type: ignore[arg-type]
        task = self._progress.add_task(description, total=total)
        for item in items:
            yield item
            self._progress.advance(task)
        self._progress.refresh()

    def counter(self, description: str, total: int, completed: int = 0) -> Callable[[str], None]:
        """A bar advanced by hand: each call moves it one step and replaces its description
        (e.g. with the latest loss and tokens/s)."""
        task = self._progress.add_task(description, total=total, completed=completed)

        def advance(new_description: str) -> None:
            self._progress.update(task, advance=1, description=new_description)

        return advance

    def log(self, message: str) -> None:
        if self.enabled:
            self._progress.console.print(message)


QUIET = Bars(enabled=False)
