"""Checks that an export's files are whole before anything reads them: ``lmpress inspect`` (``--verify`` for the
full pass), and ``generate`` / ``eval`` / the runtime before loading (the cheap pass).

Cheap (every read): each safetensors header parses, every tensor's bytes match its shape and dtype and lie inside
the file without overlapping another; config.json's layer count matches the tensors'; every scale tensor is
finite. GGUF: the magic, the version, counts a file of that size can hold, every tensor's bytes inside the file.
Full (``--verify``): every float tensor finite, GGUF tensors decoded and checked finite, ONNX through onnx's
checker, the run's manifest hashes.

Each check raises ``LmpressInputError`` with one line naming the file and the first problem.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmpress.checkpoint_files import (
    MappedSafetensors,
    first_overlap,
    read_config,
    read_tensor_headers,
    safetensors_files,
)
from lmpress.errors import LmpressInputError

if TYPE_CHECKING:
    from lmpress.export.gguf_layout import GgufLayout

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
# The fewest bytes one header entry can take: a tensor (name length, a 1-byte name, n_dims, one dim, type, offset)
# and a metadata entry (key length, a 1-byte key, value type, a 1-byte value).
MIN_TENSOR_INFO = 8 + 1 + 4 + 8 + 4 + 8
MIN_METADATA_ENTRY = 8 + 1 + 4 + 1
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
# a decoder layer's tensors: model.layers.N., model.language_model.layers.N., language_model.model.layers.N. (not a
# vision tower's encoder.layers.N.)
LAYER_INDEX = re.compile(r"(?:^|\.)(?:model|language_model)\.layers\.(\d+)\.")
GGUF_LAYER_INDEX = re.compile(r"^blk\.(\d+)\.")


def is_scale(key: str) -> bool:
    """Whether tensor ``key`` holds quantization scales (GPTQ/AWQ ``scales``, compressed-tensors ``weight_scale``,
    ``weight_global_scale``, ``input_scale``, the KV cache's ``k_scale`` / ``v_scale``)."""
    return "scale" in key.rpartition(".")[2]


def check_artifact(path: Path, full: bool = False) -> None:
    """Refuse ``path`` (a checkpoint directory, a GGUF or ONNX file, or an export directory holding one) with one
    line naming its first problem; ``full`` adds the checks that read every weight."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        check_checkpoint(path, full)
        return
    file = single_export_file(path)
    if file is None:
        return
    if file.suffix == ".gguf":
        check_gguf(file, full)
    elif full:
        check_onnx(file)


def single_export_file(path: Path) -> Path | None:
    """The GGUF or ONNX file ``path`` is, or the one its export directory holds; None otherwise."""
    path = Path(path)
    if path.is_dir():
        files = [p for p in sorted(path.iterdir()) if p.suffix in (".gguf", ".onnx")]
        return files[0] if len(files) == 1 else None
    return path if path.suffix in (".gguf", ".onnx") else None


def check_checkpoint(path: Path, full: bool = False) -> None:
    """A safetensors checkpoint directory: headers, config against tensors, finite scales (every float if
    ``full``)."""
    config = read_config(path)
    headers = read_tensor_headers(path)  # parses and checks every shard's header
    check_layer_count(path, config, list(headers))
    mapped = MappedSafetensors(safetensors_files(path))
    try:
        for key in mapped.keys():
            dtype = headers[key][0]
            if dtype in FLOAT_DTYPES and (full or is_scale(key)):
                _check_finite(path, key, mapped.tensor(key))
    finally:
        for m in mapped.maps:
            m.close()


def _check_finite(path: Path, key: str, tensor: torch.Tensor) -> None:
    values = tensor.float() if tensor.element_size() == 1 else tensor  # float8: no isfinite of its own
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise LmpressInputError(
            f"{path}: tensor {key!r} holds {bad} NaN or infinite value(s) of {tensor.numel()} (damaged: re-export it)"
        )


def layer_count(config: dict[str, Any]) -> int | None:
    """config.json's number of decoder layers (its text config's, for multimodal checkpoints); None if absent."""
    config = config.get("text_config") or config
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def check_layer_count(path: Path, config: dict[str, Any], keys: list[str]) -> None:
    """The tensors hold every decoder layer config.json claims. Layers beyond it are allowed: a config cut to
    the first layers reads a subset of the files (transformers leaves the rest unused)."""
    claimed = layer_count(config)
    held = {int(m.group(1)) for key in keys if (m := LAYER_INDEX.search(key))}
    if claimed is None or not held:
        return
    missing = sorted(set(range(claimed)) - held)
    if missing:
        raise LmpressInputError(
            f"{path}: config.json says {claimed} decoder layers, but the weights hold no tensors for layer(s) "
            f"{_some(missing)} (config and weights from different models, or a damaged export)"
        )


def _some(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:5]))
    return shown + (f" and {len(numbers) - 5} more" if len(numbers) > 5 else "")


def gguf_header_counts(file: Path) -> tuple[int, int, int]:
    """(version, tensor count, metadata count) of a GGUF file, refused when the first 24 bytes are not GGUF's or
    claim more entries than a file of its size can hold."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(24)
    if head[:4] != GGUF_MAGIC:
        raise LmpressInputError(f"{file}: not a GGUF file (starts with {head[:4]!r}, GGUF files with b'GGUF')")
    if len(head) < 24:
        raise LmpressInputError(f"{file}: a GGUF header needs 24 bytes, the file has {size} (truncated)")
    version, n_tensors, n_metadata = struct.unpack("<IQQ", head[4:24])
    if version not in GGUF_VERSIONS:
        raise LmpressInputError(f"{file}: GGUF version {version}; lmpress reads versions {GGUF_VERSIONS}")
    if n_tensors * MIN_TENSOR_INFO + n_metadata * MIN_METADATA_ENTRY > size:
        raise LmpressInputError(
            f"{file}: the header claims {n_tensors} tensors and {n_metadata} metadata entries, more than a "
            f"{size}-byte file can hold (damaged header)"
        )
    return version, n_tensors, n_metadata


def open_gguf(file: Path) -> GgufLayout:
    """``file``'s metadata and tensor table (``gguf_layout``), after the cheap checks: its header, and every
    tensor's bytes inside the file without overlapping another's."""
    from gguf.constants import GGML_QUANT_SIZES

    from lmpress.export.gguf_layout import read_gguf_layout

    file = Path(file)
    gguf_header_counts(file)
    reader = read_gguf_layout(file)
    size = file.stat().st_size
    spans = []
    for tensor in reader.tensors:
        block, _ = GGML_QUANT_SIZES[tensor.tensor_type]
        if tensor.shape and tensor.shape[0] % block:
            raise LmpressInputError(
                f"{file}: tensor {tensor.name!r} has rows of {tensor.shape[0]} values, not whole "
                f"{tensor.tensor_type.name} blocks of {block}"
            )
        start = tensor.data_offset
        end = start + tensor.n_bytes
        if end > size:
            raise LmpressInputError(
                f"{file}: tensor {tensor.name!r} lies past the end of the file ({end} > {size} bytes: truncated?)"
            )
        spans.append((start, end, tensor.name))
    overlap = first_overlap(spans)
    if overlap:
        raise LmpressInputError(f"{file}: tensors {overlap[0]!r} and {overlap[1]!r} overlap (damaged header)")
    return reader


def check_gguf(file: Path, full: bool = False) -> GgufLayout:
    """``open_gguf``'s checks, a layer count that matches the metadata, and with ``full`` every tensor decoded and
    finite; returns the reader."""
    import numpy as np
    from gguf.quants import dequantize

    reader = open_gguf(file)
    arch = gguf_field(reader, "general.architecture")
    claimed = gguf_field(reader, f"{arch}.block_count")
    held = {int(m.group(1)) for t in reader.tensors if (m := GGUF_LAYER_INDEX.match(t.name))}
    missing = sorted(set(range(claimed)) - held) if isinstance(claimed, int) and held else []
    if missing:
        raise LmpressInputError(f"{file}: the metadata says {claimed} blocks, no tensors for block(s) {_some(missing)}")
    if full:
        for tensor in reader.tensors:
            try:
                values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
            except NotImplementedError:
                continue  # a type gguf-py cannot decode: llama.cpp checks it on load
            if not np.isfinite(values).all():
                bad = int((~np.isfinite(values)).sum())
                raise LmpressInputError(f"{file}: tensor {tensor.name!r} decodes to {bad} NaN or infinite value(s)")
    return reader


def gguf_field(reader: GgufLayout, key: str, default: Any = None) -> Any:
    """A metadata value of a GGUF file, or ``default`` when the file has none."""
    return reader.fields.get(key, default)


def check_onnx(file: Path) -> None:
    """onnx's own checker over the model and its external data."""
    import onnx

    try:
        onnx.checker.check_model(str(file), full_check=False)
    except Exception as e:  # onnx raises ValidationError, DecodeError or OSError for a damaged file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LmpressInputError(f"{file}: not a valid ONNX model: {first}") from e
