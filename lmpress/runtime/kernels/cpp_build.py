"""Build a C++ library of ops once into lmpress's cache, safe against builders killed mid-build.

torch's ``cpp_extension.load`` guards a build directory with a lock file (``lock``, created exclusively, removed
when the build ends). A builder killed mid-build (Ctrl-C in the first run, a CI timeout, OOM) leaves that file
behind, and every later start waits on it forever at 0% CPU. lmpress's builds therefore take an OS lock of their own
first (``fcntl.flock`` on ``build.lock``, released by the kernel however its holder ends): whoever holds it is the only
builder of that directory, so a ``lock`` file found then is stale and is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

TORCH_BATON = "lock"  # the file torch.utils.file_baton.FileBaton creates in the build directory
OWN_LOCK = "build.lock"


def build_directory(name: str, text: bytes) -> tuple[str, Path]:
    """The library's name (``name`` + a digest of its sources and torch's version) and its directory in the cache."""
    from lmpress.cache import cache_root

    digest = hashlib.sha256(text + torch.__version__.encode()).hexdigest()[:16]
    full = f"{name}_{digest}"
    build = cache_root() / "kernels" / full
    build.mkdir(parents=True, exist_ok=True)
    return full, build


@contextlib.contextmanager
def sole_builder(build: Path) -> Iterator[None]:
    """Hold ``build``'s OS lock (waiting for another live builder) and clear a stale torch lock file left there."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; torch's own lock file is all there is
        yield
        return
    with open(build / OWN_LOCK, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # a filesystem without locks (some network mounts): torch's own lock file is all there is
            yield
            return
        try:
            stale = build / TORCH_BATON
            if stale.exists():
                print(f"lmpress: removing {stale}, left by a kernel build that was killed", file=sys.stderr)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_library(name: str, sources: Sequence[Path], build: Path, cflags: Sequence[str], **options: object) -> None:
    """Compile ``sources`` into ``build`` (once: later calls load the library) and load it, registering its ops."""
    from torch.utils.cpp_extension import load

    with sole_builder(build):
        load(
            name,
            [str(s) for s in sources],
            extra_cflags=list(cflags),
            build_directory=str(build),
            is_python_module=False,
            **options,
        )
