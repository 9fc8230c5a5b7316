"""manifest.json: every file of a run with its sha256, the recipe as run, package versions, metrics."""

from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path
from typing import Any

from lmpress.cache import sha256_file, write_json_atomic

MANIFEST = "manifest.json"
PACKAGES = ("lmpress", "torch", "transformers", "safetensors", "gguf", "accelerate", "compressed-tensors", "lm-eval")


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def file_entries(root: Path) -> list[dict[str, Any]]:
    return [
        {"path": p.relative_to(root).as_posix(), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    ]


def write_manifest(root: Path, recipe: dict[str, Any], metrics: dict[str, Any]) -> None:
    write_json_atomic(
        root / MANIFEST,
        {"files": file_entries(root), "recipe": recipe, "versions": package_versions(), "metrics": metrics},
    )


def verify_manifest(root: Path) -> list[str]:
    """Paths whose size or sha256 no longer match the manifest (missing files included)."""
    from lmpress.cache import read_json

    manifest = read_json(root / MANIFEST) or {"files": []}
    bad = []
    for entry in manifest["files"]:
        path = root / entry["path"]
        if not path.is_file() or path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            bad.append(entry["path"])
    return bad
