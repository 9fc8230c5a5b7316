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
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

TORCH_BATON = "lock"  # the file torch.utils.file_baton.FileBaton creates in the build directory
OWN_LOCK = "build.lock"


def build_directory(name: str, text: bytes, flags: Sequence[str] = ()) -> tuple[str, Path]:
    """The library's name (``name`` + a digest of its sources, the compiler and linker ``flags`` and torch's
    version) and its directory in the cache. New flags get a directory of their own: in the old one torch's load
    would rewrite ``build.ninja`` and ninja compile again, which ``build_is_stale`` (asked before) cannot foresee."""
    from lmpress.cache import cache_root

    digest = hashlib.sha256(b"\0".join([text, *(f.encode() for f in flags), torch.__version__.encode()]))
    digest = digest.hexdigest()[:16]
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


def build_is_stale(build: Path) -> bool:
    """Whether ninja would compile again in ``build``, a library built before: a file it was compiled from is newer
    than the library. A torch reinstalled at the same version gives its headers new times, and the next start
    recompiled lmpress's CPU kernels for two minutes with no word (2026-12-07, a fresh environment on the Xeon)."""
    try:
        done = subprocess.run(["ninja", "-C", str(build), "-n"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False  # no ninja: torch's load says so itself
    return done.returncode != 0 or "no work to do" not in done.stdout


def build_library(
    name: str, sources: Sequence[Path], build: Path, cflags: Sequence[str], what: str, **options: object
) -> None:
    """Compile ``sources`` into ``build`` (once: later calls load the library) and load it, registering its ops;
    a start that compiles says so first (``what`` the library is), as it takes a minute or more."""
    from torch.utils.cpp_extension import load

    with sole_builder(build):
        if not (build / f"{name}.so").exists():
            print(f"lmpress: compiling {what} once for this host and torch version, into {build}", file=sys.stderr)
        elif build_is_stale(build):
            print(
                f"lmpress: compiling {what} again: files they were built from changed since (torch reinstalled?), "
                f"into {build}",
                file=sys.stderr,
            )
        load(
            name,
            [str(s) for s in sources],
            extra_cflags=list(cflags),
            build_directory=str(build),
            is_python_module=False,
            **options,
        )
