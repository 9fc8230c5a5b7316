"""Where lmpress keeps what it can reuse between runs (converted GGUF models, baseline evals)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """``$LMPRESS_CACHE``, else ``$XDG_CACHE_HOME/lmpress``, else ``~/.cache/lmpress``."""
    if os.environ.get("LMPRESS_CACHE"):
        return Path(os.environ["LMPRESS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lmpress"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_path(p) as tmp: write(tmp)``: ``p`` appears whole, or not at all if the write fails.

    The temporary file sits beside ``p`` and keeps its suffix (so writers that pick a
    format by suffix, such as matplotlib, still do).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    # mkstemp creates the file 0600; what appears at ``path`` gets the mode any other new file would (a server
    # running as another user reads the weights and reports like every other file of the export)
    os.chmod(tmp, 0o666 & ~current_umask())
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask_modes(root: str | os.PathLike) -> None:
    """Give ``root`` and everything under it the modes new files and folders get (``0o666`` / ``0o777`` less the
    umask): writers that go through a private temporary file (safetensors' own atomic save: 0600) otherwise leave
    files another user, or a server's container, cannot read."""
    mask = current_umask()
    for path in [Path(root), *Path(root).rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: str | os.PathLike) -> Any | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def known_sha256(path: Path) -> str:
    """``sha256_file(path)``, memoized in the cache by the file's path, inode, size and modification and change
    times: a write to the file, or another file put in its place, changes one of them (the change time cannot be
    set back), so a file read again unchanged is not hashed again (a 200 MB export: 0.2-0.3 s of every load here,
    a checkpoint of gigabytes: minutes)."""
    st = path.stat()
    key = sha256_json([str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    memo = cache_root() / "sha256" / key
    if memo.exists():
        return memo.read_text().strip()
    digest = sha256_file(path)
    if time.time() - st.st_ctime > RACY_SECONDS:
        write_text_atomic(memo, digest)
    return digest


# A file changed within the file system's clock tick (a few ms) of the stat above keeps its times: one changed
# this recently is hashed every time until it is older (git's "racy" entries, handled the same way).
RACY_SECONDS = 2.0


def files_fingerprint(files: list[Path]) -> str:
    """sha256 over ``files``' names and contents (each file's hash memoized: ``known_sha256``)."""
    return sha256_json([(p.name, known_sha256(p)) for p in sorted(files)])
