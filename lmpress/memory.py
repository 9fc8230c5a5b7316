"""Peak resident memory of the process, and of one piece of work within it.

``report.json`` gives each stage the peak RSS reached *during that stage*. On
Linux the kernel's high-water mark (VmHWM) is reset by writing ``5`` to
``/proc/self/clear_refs``; elsewhere (or where that file is not writable) a
sampling thread polls the resident size instead, which can miss spikes shorter
than its period. Resetting VmHWM also resets ``getrusage``'s ``ru_maxrss``, so
this module keeps the process-wide peak itself: read it with ``process_peak_mb``.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import re
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import psutil

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_SAMPLE_SECONDS = 0.02
_peak_before_resets_mb = 0.0
P = ParamSpec("P")
T = TypeVar("T")


def _vm_hwm_mb() -> float | None:
    try:
        with open(_STATUS) as f:
            found = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) / 1024 if found else None


def _ru_maxrss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def process_peak_mb() -> float:
    """Peak resident memory of this process so far, in MiB (across any per-stage resets)."""
    return max(_peak_before_resets_mb, _vm_hwm_mb() or 0.0, _ru_maxrss_mb())


def _reset_high_water_mark() -> bool:
    global _peak_before_resets_mb
    _peak_before_resets_mb = process_peak_mb()
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    hwm = _vm_hwm_mb()
    return hwm is not None and hwm <= psutil.Process().memory_info().rss / (1 << 20) + 1


@dataclass
class PeakRSS:
    mb: float = 0.0  # filled in when the ``with`` block ends


@contextmanager
def track_peak_rss() -> Iterator[PeakRSS]:
    """``with track_peak_rss() as peak: work()`` leaves the work's own peak RSS (MiB) in ``peak.mb``."""
    result = PeakRSS()
    process = psutil.Process()
    if _reset_high_water_mark():
        try:
            yield result
        finally:
            result.mb = _vm_hwm_mb() or 0.0
        return
    samples = [process.memory_info().rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(_SAMPLE_SECONDS):
            samples.append(process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        stop.set()
        sampler.join()
        samples.append(process.memory_info().rss)
        result.mb = max(samples) / (1 << 20)


@dataclass
class RunPhases:
    """Each named phase of a run (loading, an eval, the exports, ...) with its seconds and its own peak RSS (MiB):
    what ``report.json`` gives beside each stage's, so a whole run's peak can be put down to its phase."""

    measured: dict[str, dict[str, float]] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time ``name`` and track its peak (a phase must not contain another peak tracker: they share one mark).

        What the phase freed goes back to the OS as it ends, as after each stage: glibc kept 0.6 GiB of an hf
        export's freed buffers resident into the read-back, and 1.2 GiB of the read-back's into the evals
        (SmolLM2, R4 + NVFP4, exports compressed-tensors and hf)."""
        began = time.perf_counter()
        with track_peak_rss() as peak:
            yield
        return_freed_memory()
        self.measured[name] = {"seconds": round(time.perf_counter() - began, 2), "peak_rss_mb": round(peak.mb, 1)}


def return_freed_memory() -> None:
    """Hand memory freed to the C allocator back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    Loading a model allocates transient buffers (unpacked codes, fp32 copies) between
    long-lived tensors; glibc keeps those freed pages in its heap, so without this the
    resident size after a load stays near the load's peak.
    """
    import gc

    gc.collect()
    trim_c_heap()


def trim_c_heap() -> None:
    """glibc's ``malloc_trim(0)`` alone (no garbage collection): a no-op off Linux or glibc.

    glibc hands freed heap pages back by itself only from the heap's top, and only past a threshold
    that grows with the largest blocks freed (up to 64 MiB, by its documented rules), so each
    generation's transient buffers (its KV cache, a prefill's activations) stay resident into the
    next unless handed back.
    """
    trim = getattr(c_library(), "malloc_trim", None)  # glibc's; absent from musl
    if trim is not None:
        trim(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # the ceiling of glibc's own moving threshold on 64-bit
M_TRIM_THRESHOLD = -1  # free memory at the heap's top beyond this goes back to the OS at a free
GLIBC_TRIM_THRESHOLD = 128 << 10  # its default


@contextmanager
def large_frees_unmapped(threshold: int = 1 << 20, keep_free: int = GLIBC_TRIM_THRESHOLD) -> Iterator[None]:
    """Within: glibc maps blocks of ``threshold`` bytes or more on their own, so freeing one hands it back at once,
    and keeps up to ``keep_free`` bytes freed at its heap's top for the next allocations.

    glibc raises its mmap threshold to the size of each mapped block freed (up to 32 MiB): blocks of that size
    then come from the heap and, freed between long-lived allocations, stay resident. Over a layer-wise pass
    that holds each layer's transient buffers (a Hessian, float copies of a weight) as 200-300 MiB of freed heap
    above what is live (``bench/scale.py``, the Llama-3.2-1B shape: peak 1.44 -> 1.32 GiB). Blocks under the
    threshold come from the heap and are reused; each one mapped on its own comes back as fresh pages from the
    kernel at every allocation (a page fault per 4 KiB). On exit both settings are the latest still-open block's
    (of any thread: glibc's settings are the process's), or outside any glibc's ceiling and its default trim
    (glibc cannot restore its moving rule), and a raised ``keep_free`` is handed back. A no-op off glibc."""
    mallopt = getattr(c_library(), "mallopt", None)
    setting = _HeapSetting(threshold, keep_free)
    with _heap_settings_lock:
        if mallopt is None or not mallopt(M_MMAP_THRESHOLD, threshold):
            mallopt = None
        else:
            mallopt(M_TRIM_THRESHOLD, keep_free)
            _heap_settings.append(setting)
    if mallopt is None:
        yield
        return
    try:
        yield
    finally:
        with _heap_settings_lock:
            _heap_settings.remove(setting)  # threads' blocks may close out of order
            current = _heap_settings[-1]
            mallopt(M_MMAP_THRESHOLD, current.threshold)
            mallopt(M_TRIM_THRESHOLD, current.keep_free)
            if keep_free > current.keep_free:
                trim_c_heap()


@dataclass(eq=False)  # compared by identity: two threads' blocks with the same settings are two entries
class _HeapSetting:
    threshold: int
    keep_free: int


# the settings of the open large_frees_unmapped blocks, after the process's own; glibc's settings are the process's,
# so the blocks of every thread share this stack
_heap_settings = [_HeapSetting(GLIBC_MMAP_THRESHOLD_MAX, GLIBC_TRIM_THRESHOLD)]
_heap_settings_lock = threading.Lock()


def freed_heap_reused() -> AbstractContextManager[None]:
    """Within: blocks under 32 MiB come from glibc's heap and, freed, are reused by the next allocation (nor is the
    heap's top handed back at each free); on exit the freed heap goes back to the OS and the enclosing
    ``large_frees_unmapped``'s settings hold again.

    For a loop that allocates the same buffers at every step (training a layer): with each block mapped on its
    own, every step's buffers come back as fresh pages from the kernel. Learned rounding on SmolLM2's layers took
    280,000 page faults a second, 28% of its CPU time in the kernel (2-vCPU Xeon, 2026-12-06)."""
    return large_frees_unmapped(GLIBC_MMAP_THRESHOLD_MAX, keep_free=1 << 30)


def drop_pages(address: int, length: int) -> None:
    """``madvise(MADV_DONTNEED)`` over the pages lying wholly inside ``[address, address + length)``.

    Only for memory mapped from a file and never written: the pages leave this process and come
    back from the page cache at the next touch. On anonymous memory this zeroes them."""
    first, last = pages_within(address, address + length)
    libc = c_library()
    if libc is not None and last > first:
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)


def pages_within(start: int, end: int) -> tuple[int, int]:
    """The page-aligned ``[first, last)`` inside ``[start, end)``: the pages no neighbour shares."""
    return -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE


def trims_heap_after(generator_function: Callable[P, Iterator[T]]) -> Callable[P, Iterator[T]]:
    """Make a generator function (a decode loop) call ``trim_c_heap`` when it ends, finished or closed early:
    after the loop's own frame, which holds its KV cache, has been freed."""

    @functools.wraps(generator_function)
    def generate(*args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        try:
            yield from generator_function(*args, **kwargs)
        finally:
            trim_c_heap()

    return generate


@functools.cache
def c_library() -> Any:
    """This process's C library (ctypes), or None off Linux."""
    return ctypes.CDLL(None) if sys.platform.startswith("linux") else None
