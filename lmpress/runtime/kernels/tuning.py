"""Autotuned choices, kept on disk so that a second ``lmpress generate`` does not tune again.

A choice (a Triton tile configuration, or which library kernel runs a layer shape) is timed
once per key and written to ``kernel_tuning.json`` under lmpress's cache directory
(``$LMPRESS_TUNE_CACHE`` names another file). The key holds everything that can change the
answer: the GPU's name, the kernel, the shape, the candidates offered and the versions of torch,
triton, gemlite and lmpress; anything else reads as a miss and is tuned afresh. Within a process a
dict answers after the first lookup, so a launch pays one dict lookup.

``set_tune_space`` sets how much is tuned: ``full`` (default: every configuration of a kernel),
``small`` (a fixed few per kernel, for a short GPU visit: ``bench/*.py --tune small``) or ``off``
(one fixed configuration, no timing).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from lmpress.cache import cache_root, read_json, write_json_atomic

SPACES = ("full", "small", "off")
FORMAT = 1


_space = "full"


def tune_space() -> str:
    """How much is tuned in this process: ``full``, ``small`` or ``off`` (``set_tune_space``)."""
    return _space


def set_tune_space(space: str) -> None:
    """Tune every configuration (``full``), a fixed few (``small``) or none (``off``) from now on."""
    global _space
    if space not in SPACES:
        raise ValueError(f"autotune space {space!r}: expected one of {', '.join(SPACES)}")
    _space = space


def cache_path() -> Path:
    return Path(os.environ.get("LMPRESS_TUNE_CACHE") or cache_root() / "kernel_tuning.json")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@functools.cache  # a metadata lookup scans sys.path: milliseconds, and a kernel launch may ask
def versions() -> dict[str, str | None]:
    """The versions a tuned choice depends on."""
    return {name: _version(name) for name in ("torch", "triton", "gemlite", "lmpress")}


def tune_key(device_name: str, kernel: str, shape: dict[str, Any], candidates: Sequence[Any]) -> str:
    return json.dumps(
        {"device": device_name, "kernel": kernel, "shape": shape, "candidates": list(candidates), **versions()},
        sort_keys=True,
    )


class TuneCache:
    """Tuned choices of one file: ``get`` reads it once; ``put`` merges into what is on disk, then replaces it."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_path()
        self._entries: dict[str, Any] | None = None

    def _read(self) -> dict[str, Any]:
        data = read_json(self.path) if self.path.is_file() else None
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("choices"), dict):
            return {}  # absent, unreadable or another format: tune again (and overwrite it)
        return data["choices"]

    def get(self, key: str) -> Any | None:
        if self._entries is None:
            self._entries = self._read()
        return self._entries.get(key)

    def put(self, key: str, value: Any) -> None:
        entries = self._read()  # another process may have tuned other shapes meanwhile
        entries[key] = value
        try:
            write_json_atomic(self.path, {"format": FORMAT, "choices": entries})
        except OSError:
            pass  # a read-only cache directory costs a retune next time, not the run
        self._entries = entries


_CACHES: dict[Path, TuneCache] = {}
_CHOSEN: dict[str, Any] = {}
_REMEMBERED: dict[tuple, Any] = {}


def default_cache() -> TuneCache:
    path = cache_path()
    if path not in _CACHES:
        _CACHES[path] = TuneCache(path)
    return _CACHES[path]


def tuned_choice(
    device_name: str,
    kernel: str,
    shape: dict[str, Any],
    candidates: Sequence[Any],
    seconds: Callable[[Any], float],
    cache: TuneCache | None = None,
) -> Any:
    """The candidate ``seconds`` times fastest for (device, kernel, shape): from memory, from disk, or timed now.

    Candidates are JSON values (a config's keyword dict, a kernel name). A candidate whose timing raises
    counts as infinitely slow; if all do, the first is returned (and not stored).
    """
    if len(candidates) == 1:
        return candidates[0]
    key = tune_key(device_name, kernel, shape, candidates)
    if key in _CHOSEN:
        return _CHOSEN[key]
    cache = cache or default_cache()
    stored = cache.get(key)
    if stored is not None and stored in candidates:
        _CHOSEN[key] = stored
        return stored
    times = []
    for candidate in candidates:
        try:
            times.append(seconds(candidate))
        except Exception:  # a configuration that does not compile or run here is simply not chosen
            times.append(math.inf)
    best = min(range(len(candidates)), key=times.__getitem__)
    if math.isinf(times[best]):
        return candidates[0]
    _CHOSEN[key] = candidates[best]
    cache.put(key, candidates[best])
    return candidates[best]


def remembered(key: tuple, choose: Callable[[], Any]) -> Any:
    """``choose()`` once per hashable ``key`` in this process: a kernel launch's lookup of its tuned choice
    costs a dict lookup, not ``tune_key``'s JSON of every candidate (about a millisecond)."""
    if key not in _REMEMBERED:
        _REMEMBERED[key] = choose()
    return _REMEMBERED[key]


def forget_in_memory() -> None:
    """Drop the in-process answers (the on-disk cache stays): what a new process starts with."""
    _CHOSEN.clear()
    _REMEMBERED.clear()
    _CACHES.clear()
