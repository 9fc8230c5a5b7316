"""Per-stage peak RSS: the stage's own peak, not the process's so far.

Each scenario runs in a fresh Python process: in the test session's own process (over a
gigabyte resident after hundreds of tests) memory freed by earlier tests goes back to the
OS while a scenario measures, which moves its baseline by tens of megabytes.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from lmpress.memory import process_peak_mb, return_freed_memory, track_peak_rss


def resident_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / (1 << 20)


def touch(mb: int) -> np.ndarray:
    return np.ones(mb << 17)  # float64: 8 bytes each, every page written


def a_stage_peak_excludes_what_came_before_and_the_process_peak_keeps_it() -> None:
    big = touch(400)
    before = process_peak_mb()
    del big
    with track_peak_rss() as peak:
        small = touch(50)
        del small
    assert peak.mb < before - 200  # the 400 MB spike before the stage is not this stage's
    assert process_peak_mb() >= before - 2  # ... but the process peak keeps it (the kernel counts RSS loosely)
    start = resident_mb()
    with track_peak_rss() as second:
        held = touch(150)
    # Against the resident size just before the stage (not the first stage's peak: 150 MB held
    # here less the 50 MB touched there is exactly the 100 MB margin, with nothing to spare).
    assert second.mb > start + 140
    del held


def without_a_resettable_high_water_mark_a_sampler_measures_the_peak() -> None:
    import time

    import lmpress.memory

    lmpress.memory._reset_high_water_mark = lambda: False
    return_freed_memory()
    start = resident_mb()
    with track_peak_rss() as busy:
        held = touch(200)
        time.sleep(0.1)  # several sampling periods
    del held
    assert busy.mb > start + 150
    big = touch(300)
    del big
    return_freed_memory()
    start = resident_mb()
    with track_peak_rss() as quiet:
        time.sleep(0.05)
    assert quiet.mb < start + 100  # the 300 MB before the stage is not its peak


SCENARIOS = {
    "stage_peak": a_stage_peak_excludes_what_came_before_and_the_process_peak_keeps_it,
    "sampler": without_a_resettable_high_water_mark_a_sampler_measures_the_peak,
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_peak_rss_scenario_in_a_fresh_process(scenario):
    done = subprocess.run([sys.executable, __file__, scenario], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()


FREED_IN_THE_HEAP = """
import sys, torch
from lmpress.memory import large_frees_unmapped

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

def freed_mb():
    first = torch.ones(2 << 20)  # 8 MiB, mapped; freeing it raises glibc's threshold to 8 MiB
    del first
    blocks, pins = [], []
    for _ in range(8):  # 64 MiB of 8 MiB blocks, each followed by a long-lived 1 MiB tensor
        blocks.append(torch.ones(2 << 20))
        # 1 MiB: a smaller pin may land in any free chunk of the heap (where depends on the import's layout), leaving
        # blocks side by side that glibc then trims from the heap's top
        pins.append(torch.ones(256 << 10))
    before = rss_mb()
    del blocks
    return before - rss_mb()

if sys.argv[1] == "unmapped":
    with large_frees_unmapped():
        print(freed_mb())
else:
    print(freed_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_frees_unmapped_hands_freed_blocks_back_where_glibc_keeps_them():
    def freed(mode: str) -> float:
        done = subprocess.run([sys.executable, "-c", FREED_IN_THE_HEAP, mode], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return float(done.stdout)

    assert freed("default") < 16  # glibc keeps the freed blocks between the pins resident
    assert freed("unmapped") > 56  # all eight blocks handed back


HEAP_REUSED = """
import ctypes, resource
from lmpress.memory import freed_heap_reused, large_frees_unmapped

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

def written(size):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    return block

def faults_per_step():  # minor page faults of a step that allocates, writes and frees 8 MiB (after a first one)
    libc.free(written(8 << 20))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        libc.free(written(8 << 20))
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20

def freed_between_pins(size):  # the resident MiB freed by freeing 8 blocks of size, each followed by a kept one
    blocks, pins = [], []
    for _ in range(8):
        blocks.append(written(size))
        pins.append(written(1 << 20))
    before = rss_mb()
    for block in blocks:
        libc.free(block)
    return before - rss_mb()

with large_frees_unmapped():
    unmapped = faults_per_step()
    with freed_heap_reused():
        reused = faults_per_step()
        freed_within = freed_between_pins(8 << 20)  # freed blocks between long-lived pins: kept within
        kept = rss_mb()
    handed_back = kept - rss_mb()  # ... and handed back on leaving
    # 9 MiB: no freed 8 MiB chunk fits, so the blocks are new ones, mapped on their own again
    after = freed_between_pins(9 << 20)
print(unmapped, reused, freed_within, handed_back, after)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_heap_reused_within_then_handed_back_and_the_threshold_restored():
    """Within ``freed_heap_reused`` a step's 8 MiB buffer reuses the last step's pages (no page faults) where the
    engine's ``large_frees_unmapped`` maps it afresh (2,048 faults); leaving hands the freed heap back to the OS and
    maps large blocks on their own again (freed, they leave at once)."""
    done = subprocess.run([sys.executable, "-c", HEAP_REUSED], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    unmapped, reused, freed_within, handed_back, after = map(float, done.stdout.split())
    assert unmapped > 1800  # every step's 2,048 pages fresh from the kernel
    assert reused < 100
    assert freed_within < 8
    assert handed_back > 56  # the eight freed blocks between the pins
    assert after > 64  # eight 9 MiB blocks handed back as they are freed


ENGINE_HEAP = """
import ctypes, resource
from lmpress.calib.engine import HEAP_KEPT_BYTES, MAPPED_FROM_BYTES
from lmpress.memory import large_frees_unmapped

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]

def faults_per_step(size):  # minor page faults of a step that allocates, writes and frees size bytes
    def step():
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10

with large_frees_unmapped():
    with large_frees_unmapped(MAPPED_FROM_BYTES, keep_free=HEAP_KEPT_BYTES):
        batch = faults_per_step(8 << 20)
        hessian = faults_per_step(20 << 20)
    after = faults_per_step(8 << 20)
print(batch, hessian, after)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_calibration_pass_reuses_batch_buffers_and_maps_large_ones():
    """Within the engine's pass a batch's 8 MiB buffer reuses the last batch's pages, even at the heap's top (kept,
    not trimmed at each free); a 20 MiB one (a Hessian) is mapped on its own (5,120 fresh pages a step); leaving
    restores the enclosing block's 1 MiB threshold and default trim."""
    done = subprocess.run([sys.executable, "-c", ENGINE_HEAP], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    batch, hessian, after = map(float, done.stdout.split())
    assert batch < 100
    assert hessian > 4500
    assert after > 1800


def test_heap_settings_are_the_latest_open_blocks_when_threads_close_them_out_of_order(monkeypatch):
    """glibc's settings are the process's: two threads' blocks that close in the order they opened leave the
    settings of the block still open, then the process's own, never the first block's restored over the second."""
    import threading

    from lmpress import memory

    calls: list[tuple[int, int]] = []

    class RecordingLibc:
        def mallopt(self, parameter: int, value: int) -> int:
            calls.append((parameter, value))
            return 1

        def malloc_trim(self, pad: int) -> int:
            return 1

    monkeypatch.setattr(memory, "c_library", lambda: RecordingLibc())

    def settings() -> tuple[int, int]:
        mmap_at = [v for p, v in calls if p == memory.M_MMAP_THRESHOLD][-1]
        trim_at = [v for p, v in calls if p == memory.M_TRIM_THRESHOLD][-1]
        return mmap_at, trim_at

    first_open, first_may_close = threading.Event(), threading.Event()

    def first() -> None:
        with memory.large_frees_unmapped(1 << 20):
            first_open.set()
            first_may_close.wait()

    thread = threading.Thread(target=first)
    thread.start()
    first_open.wait()
    with memory.large_frees_unmapped(16 << 20, keep_free=64 << 20):
        assert settings() == (16 << 20, 64 << 20)
        first_may_close.set()
        thread.join()
        assert settings() == (16 << 20, 64 << 20)  # the first block closed; the second still holds
    assert settings() == (memory.GLIBC_MMAP_THRESHOLD_MAX, memory.GLIBC_TRIM_THRESHOLD)
    assert len(memory._heap_settings) == 1


FREED_IN_A_PHASE = """
import torch
from lmpress.memory import RunPhases

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

first = torch.ones(2 << 20)  # as above: glibc's threshold raised to 8 MiB, so the blocks come from the heap
del first
pins = []
with RunPhases().phase("work"):
    blocks = []
    for _ in range(8):
        blocks.append(torch.ones(2 << 20))
        pins.append(torch.ones(256 << 10))
    before = rss_mb()
    del blocks
print(before - rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_a_run_phase_hands_what_it_freed_back_to_the_os():
    done = subprocess.run([sys.executable, "-c", FREED_IN_A_PHASE], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) > 56  # the eight 8 MiB blocks between the pins, resident by glibc's rule otherwise
