"""Give memory pages back to the kernel during long layer-wise runs.

Float weights: transformers loads a safetensors checkpoint as a private file
mapping, so a layer's float weights become resident as the layer-wise engine reads them, and
stay counted in the process's RSS after quantized weights replace them, so
without this the RSS grows by the whole float model over a run. ``madvise(
MADV_DONTNEED)`` on a private *file* mapping discards our copy of the pages; a
later read would fault the checkpoint's bytes back in from the file. It is only
applied to such mappings (anonymous memory would read back as zeros) and only to
whole pages inside the tensor.

The heap: freed temporaries stay with the allocator; ``trim_heap`` hands them
back between passes.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

MADV_DONTNEED = 4

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        _libc = None


def _private_file_mapping(start: int, end: int) -> bool:
    """Whether [start, end) lies inside one private mapping of a regular file."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= start < high:
                return end <= high and fields[1].endswith("p") and len(fields) >= 6 and fields[5].startswith("/")
    return False


def file_mapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes are a view of a file mapped privately (a checkpoint's weights read in place)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return False
    start = tensor.data_ptr()
    return _private_file_mapping(start, start + tensor.numel() * tensor.element_size())


def drop_file_pages(tensor: torch.Tensor) -> bool:
    """Discard the resident pages under ``tensor`` when it is backed by a private file mapping.

    The caller must no longer use ``tensor``. Returns True when pages were dropped.
    """
    if _libc is None or tensor.device.type != "cpu" or tensor.numel() == 0 or not tensor.is_contiguous():
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first or not _private_file_mapping(start, end):
        return False
    return _libc.madvise(first, last - first, MADV_DONTNEED) == 0


def trim_heap() -> None:
    """Return the heap's free pages to the kernel (glibc ``malloc_trim``).

    Each calibration pass leaves the allocator holding freed temporaries scattered
    through the heap; trimming between passes keeps that from piling up.
    """
    if _libc is not None:
        _libc.malloc_trim(0)
