"""Progress where no terminal is: plain lines with elapsed time and ETA, written while the work runs."""

import io

from rich.console import Console

from lmpress import progress
from lmpress.progress import Bars


def log_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=200), out


def test_plain_lines_every_tenth_while_the_work_runs():
    console, out = log_console()
    seen_midway = None
    with Bars(console=console) as bars:
        assert bars.plain
        for i in bars.track(range(100), "gptq: layers"):
            if i == 55:
                seen_midway = out.getvalue()
    lines = out.getvalue().splitlines()
    assert (
        "gptq: layers: 50/100 (50%) elapsed 0:00:00 eta 0:00:00" in seen_midway and "60/100" not in seen_midway
    )  # printed as it happened
    assert len(lines) == 10 and lines[-1].startswith("gptq: layers: 100/100 (100%)")


def test_plain_lines_at_least_every_30_seconds(monkeypatch):
    console, out = log_console()
    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    with Bars(console=console) as bars:
        advance = bars.counter("distill: steps", total=1000)
        for _ in range(3):
            now[0] += 31
            advance("distill: loss 2.1")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[1] == "distill: loss 2.1: 2/1000 (0%) elapsed 0:01:02 eta 8:35:38"


def test_terminal_keeps_live_bars_and_quiet_prints_nothing():
    console, out = log_console()
    with Bars(enabled=False, console=console) as bars:
        list(bars.track(range(10), "x"))
    assert out.getvalue() == ""
    assert not Bars(console=Console(file=io.StringIO(), force_terminal=True)).plain


def test_a_step_longer_than_the_interval_repeats_its_line_and_a_closed_task_stays_quiet(monkeypatch):
    """A layer that takes minutes (a large model's) must not leave a CI log silent: the open task's line comes
    again every interval while the step runs; once the task is over nothing more is printed for it."""
    import time

    monkeypatch.setattr(progress, "PLAIN_EVERY_SECONDS", 0.2)
    console, out = log_console()
    with Bars(console=console) as bars:
        for _ in bars.track(range(2), "gptq: layers"):
            time.sleep(0.7)  # one long step
        after_task = out.getvalue()
        time.sleep(0.5)  # other work, no task open
        assert out.getvalue() == after_task
    lines = out.getvalue().splitlines()
    beats = [line for line in lines if line.startswith("gptq: layers: 0/2")]
    assert len(beats) >= 2  # the first step alone: lines while it ran
    assert lines[-1].startswith("gptq: layers: 2/2 (100%)")


def test_an_activity_without_steps_says_it_is_still_going(monkeypatch):
    """An export or a runtime check has no steps: in a log its line comes every interval while it lasts (with the
    time so far) and nothing once it is over; a short one prints nothing; quiet bars take it too."""
    import time

    monkeypatch.setattr(progress, "PLAIN_EVERY_SECONDS", 0.2)
    console, out = log_console()
    with Bars(console=console) as bars:
        with bars.activity("exporting gguf"):
            pass
        assert out.getvalue() == ""
        with bars.activity("exporting gguf"):
            time.sleep(0.7)
        over = out.getvalue()
        time.sleep(0.5)
        assert out.getvalue() == over
    assert len(over.splitlines()) >= 2 and all(
        line.startswith("exporting gguf: elapsed 0:00:00") for line in over.splitlines()
    )
    for bars in (Bars(enabled=False, console=console), Bars(console=Console(file=io.StringIO(), force_terminal=True))):
        with bars, bars.activity("x"):  # quiet, and a terminal's open-ended bar, removed after
            assert not bars.plain
        assert not bars._progress.tasks
