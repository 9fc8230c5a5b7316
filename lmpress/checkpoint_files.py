"""Reading a checkpoint directory's files: config.json, the safetensors shards and their index.

The one home of checkpoint reading for the exporters' readers, the loader and the runtime: whole files
(``read_tensors``), headers only (``read_tensor_headers``) or memory-mapped (``MappedSafetensors``).
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import struct
from pathlib import Path
from typing import Any

import torch

from lmpress.errors import LmpressInputError
from lmpress.memory import pages_within
from lmpress.registry import ExportFormat, readable_methods, reading_format

SAFETENSORS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
}


class MappedSafetensors:
    """Every tensor of a checkpoint's safetensors files as a zero-copy view of the memory-mapped file."""

    def __init__(self, files: list[Path]) -> None:
        self.maps: list[mmap.mmap] = []
        self.where: dict[str, tuple[int, int, int, str, list[int]]] = {}  # key -> (file, start, end, dtype, shape)
        for index, file in enumerate(files):
            mapped = _map_file(file)
            self.maps.append(mapped)
            for key, (dtype, shape, start, end) in _header(file, mapped).items():
                self.where[key] = (index, start, end, dtype, shape)

    def keys(self) -> list[str]:
        return list(self.where)

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def readable(self, key: str) -> bool:
        """Whether ``key``'s dtype is one torch reads (sub-byte and other packed types are not)."""
        return SAFETENSORS_DTYPES.get(self.where[key][3]) is not None

    def tensor(self, key: str) -> torch.Tensor:
        index, start, end, dtype, shape = self.where[key]
        if SAFETENSORS_DTYPES.get(dtype) is None:
            raise LmpressInputError(f"tensor {key!r} has dtype {dtype}, which the runtime does not read")
        flat = torch.frombuffer(self.maps[index], dtype=SAFETENSORS_DTYPES[dtype], count=math.prod(shape), offset=start)
        return flat.reshape(shape) if end > start else torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype])

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {key: self.tensor(key) for key in self.where if key.startswith(prefix)}

    def release(self, prefix: str) -> int:
        """Drop the file's pages under every tensor whose key starts with ``prefix`` (read already, copied);
        returns those tensors' bytes."""
        released = 0
        for key, (index, start, end, _, _) in self.where.items():
            first, last = pages_within(start, end)
            if key.startswith(prefix):
                released += end - start
                if last > first:
                    self.maps[index].madvise(mmap.MADV_DONTNEED, first, last - first)
        return released


def _map_file(file: Path) -> mmap.mmap:
    with open(file, "rb") as handle:
        try:
            return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError as e:  # an empty file
            raise LmpressInputError(f"{file}: not a readable safetensors file ({e})") from e


# bytes per element of each safetensors dtype (sub-byte types: None, their sizes are not checked here)
SAFETENSORS_ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip


def _header(file: Path, mapped: mmap.mmap) -> dict[str, tuple[str, list[int], int, int]]:
    """safetensors layout: an 8-byte little-endian header length, a JSON header, then the data. Every tensor's
    bytes must match its shape and dtype, lie inside the file and not overlap another's (the one parser every
    reader here goes through, so none reads what another refuses)."""
    try:
        (length,) = struct.unpack("<Q", mapped[:8])
        if 8 + length > len(mapped):
            raise ValueError(f"the header claims {length} bytes, more than the file holds")
        header = json.loads(mapped[8 : 8 + length])
        base = 8 + length
        entries = {}
        for key, entry in header.items():
            if key != "__metadata__":
                start, end = entry["data_offsets"]
                entries[key] = (entry["dtype"], [int(n) for n in entry["shape"]], base + int(start), base + int(end))
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
        raise LmpressInputError(f"{file}: not a readable safetensors file (damaged or truncated?): {e}") from e
    for key, (dtype, shape, start, end) in entries.items():
        if end > len(mapped) or start > end:
            raise LmpressInputError(
                f"{file}: not a readable safetensors file: tensor {key!r} lies past the end of the file (truncated?)"
            )
        item = SAFETENSORS_ITEM_BYTES.get(dtype)
        if item is not None and end - start != math.prod(shape) * item:
            raise LmpressInputError(
                f"{file}: tensor {key!r} ({dtype}, shape {shape}) should take {math.prod(shape) * item} bytes, "
                f"its offsets give {end - start} (damaged header)"
            )
    overlap = first_overlap([(start, end, key) for key, (_, _, start, end) in entries.items()])
    if overlap:
        raise LmpressInputError(f"{file}: tensors {overlap[0]!r} and {overlap[1]!r} overlap (damaged header)")
    return entries


def first_overlap(spans: list[tuple[int, int, str]]) -> tuple[str, str] | None:
    """The names of two (start, end, name) byte ranges that overlap, or None (empty ranges never do)."""
    ordered = sorted(span for span in spans if span[1] > span[0])
    for (_, end, name), (start, _, other) in itertools.pairwise(ordered):
        if start < end:
            return name, other
    return None


def safetensors_header(file: Path) -> dict[str, tuple[str, list[int]]]:
    """Each tensor's dtype and shape in one safetensors file, from its (checked) header."""
    mapped = _map_file(file)
    try:
        return {key: (dtype, shape) for key, (dtype, shape, _, _) in _header(file, mapped).items()}
    finally:
        mapped.close()


def read_config(path: Path) -> dict[str, Any]:
    path = Path(path)
    config_path = path / CONFIG_NAME
    if not config_path.is_file():
        raise LmpressInputError(f"{path}: no {CONFIG_NAME}; expected a checkpoint directory")
    return read_json_file(config_path)


def read_json_file(file: Path) -> dict[str, Any]:
    """A JSON file's contents; one clear error if it is not valid JSON."""
    try:
        return json.loads(Path(file).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LmpressInputError(f"{file}: not valid JSON ({e})") from e


def safetensors_files(path: Path) -> list[Path]:
    path = Path(path)
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise LmpressInputError(f"{index}: not a safetensors index ({e})") from e
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / SAFETENSORS_NAME
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise LmpressInputError(f"{path}: no .safetensors weights")
    return found


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """All tensors of one file; a damaged or truncated file is a one-line LmpressInputError."""
    from safetensors import safe_open

    if not file.is_file():
        raise LmpressInputError(f"{file}: missing")
    try:
        with safe_open(str(file), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # safetensors raises its own error types and OSError for damaged files
        raise LmpressInputError(
            f"{file}: not a readable safetensors file (damaged or truncated?): {_first_line(e)}"
        ) from e


def read_tensor_headers(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Each tensor's safetensors dtype ("F32", "I32", ...) and shape, from the file headers only.

    A sharded checkpoint's index must match its shards: every file it names exists and holds the tensors it
    names (a shard from another download, or one missing, is refused here, before any weight is read)."""
    headers, held_by = {}, {}
    for file in safetensors_files(path):
        if not file.is_file():
            raise LmpressInputError(f"{path / INDEX_NAME} names the shard {file.name}, which is missing from {path}")
        for key, (dtype, shape) in safetensors_header(file).items():
            headers[key] = (dtype, shape)
            held_by[key] = file.name
    index = path / INDEX_NAME
    if index.is_file():
        for key, name in json.loads(index.read_text())["weight_map"].items():
            if held_by.get(key) != name:
                where = f"it is in {held_by[key]}" if key in held_by else "no shard holds it"
                raise LmpressInputError(
                    f"{index}: says tensor {key} is in {name}, but {where} (the shards do not match their index)"
                )
    return headers


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        tensors.update(read_safetensors(file))
    return tensors


def quant_method(config: dict[str, Any]) -> str | None:
    qc = config.get("quantization_config") or config.get("compression_config")
    return None if not qc else str(qc.get("quant_method", "unknown"))


def require_tensor(tensors: dict[str, torch.Tensor], key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    if key not in tensors:
        raise LmpressInputError(f"checkpoint has no tensor {key!r} (incomplete or not this format)")
    tensor = tensors[key]
    if dtype is not None and tensor.dtype != dtype:
        raise LmpressInputError(f"checkpoint tensor {key!r} is {tensor.dtype}, expected {dtype}")
    return tensor


def check_shape(key: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise LmpressInputError(f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}, expected {expected}")


def group_count(in_features: int, group_size: int, layer: str) -> int:
    if group_size == -1:
        return 1
    if group_size <= 0 or in_features % group_size:
        raise LmpressInputError(f"{layer}: group size {group_size} does not divide in_features {in_features}")
    return in_features // group_size


def quantized_format(path: Path, config: dict[str, Any]) -> ExportFormat | None:
    """The format that reads the quantized checkpoint at ``path`` (``config``: its config.json); None when dense."""
    method = quant_method(config)
    if method is None:
        return None
    fmt = reading_format(method)
    if fmt is None:
        readable = ", ".join(readable_methods())
        raise LmpressInputError(f"{path}: quantization method {method!r} is not one lmpress reads ({readable})")
    return fmt
