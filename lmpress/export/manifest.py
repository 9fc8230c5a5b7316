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


def verify_manifest(root: Path, prefix: str = "", rehash: bool = True) -> list[str]:
    """Paths (under ``prefix``) whose size or sha256 no longer match the manifest, missing files included. Without
    ``rehash``, a file unchanged since it was last hashed (``known_sha256``) is not read again."""
    from lmpress.cache import known_sha256, read_json

    manifest = read_json(Path(root) / MANIFEST)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        from lmpress.errors import LmpressInputError

        raise LmpressInputError(f"{Path(root) / MANIFEST}: not a readable lmpress manifest")
    bad = []
    for entry in manifest["files"]:
        if not str(entry.get("path", "")).startswith(prefix):
            continue
        path = Path(root) / entry["path"]
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            bad.append(entry["path"])
        elif (sha256_file(path) if rehash else known_sha256(path)) != entry["sha256"]:
            bad.append(entry["path"])
    return bad


def verify_artifact(path: Path, rehash: bool = False) -> None:
    """Refuse an artifact inside a run directory whose files differ from the run's manifest.json.

    ``path`` is one export (``RUN/gptq``) or a whole run; a directory without a
    manifest beside or inside it is not checked. ``rehash``: read every file again, even one unchanged since
    it was last hashed (``inspect --verify``).
    """
    from lmpress.errors import LmpressInputError

    path = Path(path)
    for root, prefix in ((path, ""), (path.parent, f"{path.name}/")):
        if (root / MANIFEST).is_file():
            bad = verify_manifest(root, prefix, rehash)
            if bad:
                more = f"; {len(bad) - 1} more file(s) differ" if len(bad) > 1 else ""
                raise LmpressInputError(
                    f"{root / bad[0]}: does not match {root / MANIFEST} (missing, or its size or sha256 differs: "
                    f"damaged or changed after the run){more}"
                )
            return
