"""A GGUF file's header, metadata and tensor table, parsed with ``struct`` over one memory map (GGUF versions 2 and
3, little-endian: what llama.cpp and lmpress write).

gguf-py's ``GGUFReader`` reads the same, but builds numpy views for every part of every string: SmolLM2's
tokenizer (49,152 tokens and 48,900 merges) took it 2.2 s of the 5.4 s ``lmpress generate`` spent loading a GGUF
export on a 2-vCPU Xeon. This reads it in a tenth of a second, refusing a damaged file with one line
(``LmpressInputError``); the tests hold it to gguf-py's reading of the same files. The tensor types, their block
and byte sizes and their decoders stay gguf-py's (``gguf.constants``, ``gguf.quants``).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from lmpress.errors import LmpressInputError

# GGUF's metadata value types (gguf.constants.GGUFValueType) as struct formats; 8 is a string, 9 an array
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY, UINT32 = 8, 9, 4
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# tensor types gguf-py reads as typed arrays of their elements; every other type as rows of bytes
ELEMENT_DTYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GgufTensor:
    """One entry of the tensor table: ``shape`` in GGUF's order (the innermost dimension first), ``data_offset``
    from the start of the file; ``data`` views the file (element-typed, or for block types ``uint8`` rows of
    blocks, as gguf-py's reader shapes it)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data_offset: int
    n_elements: int
    n_bytes: int
    file: np.memmap

    @property
    def data(self) -> np.ndarray:
        dims = tuple(reversed(self.shape))
        dtype = ELEMENT_DTYPES.get(self.tensor_type)
        raw = self.file[self.data_offset : self.data_offset + self.n_bytes]
        if dtype is None:
            return raw.reshape(quant_shape_to_byte_shape(dims, self.tensor_type))
        return raw.view(dtype).reshape(dims)


@dataclass(frozen=True)
class GgufLayout:
    """A parsed GGUF file: its metadata values by key (strings, numbers, lists) and its tensor table."""

    version: int
    fields: dict[str, Any]
    tensors: list[GgufTensor]
    data_offset: int


class _Cursor:
    """Reads GGUF's little-endian values from ``buffer`` forward, refusing any read past its end."""

    def __init__(self, buffer: memoryview, file: Path) -> None:
        self.buffer, self.file, self.offset = buffer, file, 0

    def take(self, size: int, what: str) -> int:
        start = self.offset
        if size < 0 or start + size > len(self.buffer):
            raise LmpressInputError(
                f"{self.file}: {what} at byte {start} runs past the end of the file ({len(self.buffer)} bytes: "
                "damaged or truncated)"
            )
        self.offset = start + size
        return start

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from("<" + fmt, self.buffer, self.take(size, what))[0]

    def string(self, what: str) -> str:
        length = self.scalar("Q", what)
        start = self.take(length, what)
        try:
            return str(self.buffer[start : start + length], "utf-8")
        except UnicodeDecodeError as error:
            raise LmpressInputError(f"{self.file}: {what} at byte {start} is not UTF-8 ({error.reason})") from None

    def value(self, kind: int, what: str) -> Any:
        if kind == STRING:
            return self.string(what)
        if kind == ARRAY:
            return self.array(what)
        fmt = SCALAR_FORMATS.get(kind)
        if fmt is None:
            raise LmpressInputError(f"{self.file}: {what} has value type {kind}, not one GGUF defines (damaged header)")
        return self.scalar(fmt, what)

    def array(self, what: str) -> list[Any]:
        kind, count = self.scalar("I", what), self.scalar("Q", what)
        fmt = SCALAR_FORMATS.get(kind)
        if fmt is not None:  # numbers: one read, however many
            size = struct.calcsize(fmt) * count
            return np.frombuffer(self.buffer, np.dtype("<" + fmt), count, self.take(size, what)).tolist()
        if count * 8 > len(self.buffer) - self.offset:  # each string or array takes at least its 8-byte length
            self.take(count * 8, f"{what} ({count} entries)")
        return [self.value(kind, what) for _ in range(count)]


def read_gguf_layout(file: Path) -> GgufLayout:
    """The metadata and tensor table of GGUF ``file``, its tensors' bytes left in the file (``GgufTensor.data``).
    Refused with one line: another magic or version, a big-endian file, a value or entry past the end of the file,
    an unknown value or tensor type, a duplicate tensor name, a bad alignment."""
    file = Path(file)
    mapped = np.memmap(file, mode="r") if file.stat().st_size else np.zeros(0, np.uint8)
    cursor = _Cursor(memoryview(mapped), file)
    if bytes(cursor.buffer[: cursor.take(4, "the magic") + 4]) != b"GGUF":
        raise LmpressInputError(f"{file}: not a GGUF file (it does not start with b'GGUF')")
    version = cursor.scalar("I", "the version")
    if version & 0xFFFF == 0:
        raise LmpressInputError(f"{file}: a big-endian GGUF file; lmpress reads little-endian ones")
    if version not in (2, 3):
        raise LmpressInputError(f"{file}: GGUF version {version}; lmpress reads versions 2 and 3")
    n_tensors, n_fields = cursor.scalar("Q", "the tensor count"), cursor.scalar("Q", "the metadata count")
    fields: dict[str, Any] = {}
    alignment = DEFAULT_ALIGNMENT
    for index in range(n_fields):
        key = cursor.string(f"metadata entry {index}'s key")
        kind = cursor.scalar("I", f"metadata {key!r}'s type")
        fields[key] = cursor.value(kind, f"metadata {key!r}")
        if key == "general.alignment":
            alignment = fields[key]
            if kind != UINT32 or alignment <= 0 or alignment & (alignment - 1):
                raise LmpressInputError(f"{file}: general.alignment {alignment!r} is not a power of two (uint32)")
    table = [_tensor_entry(cursor, index) for index in range(n_tensors)]
    data_offset = -(-cursor.offset // alignment) * alignment
    tensors, names = [], set()
    for name, dims, raw_type, offset in table:
        if name in names:
            raise LmpressInputError(f"{file}: tensor {name!r} appears twice in the tensor table (damaged header)")
        names.add(name)
        try:
            kind = GGMLQuantizationType(raw_type)
        except ValueError:
            raise LmpressInputError(f"{file}: tensor {name!r} has type {raw_type}, not one ggml defines") from None
        block, type_size = GGML_QUANT_SIZES[kind]
        elements = math.prod(dims)
        n_bytes = elements // block * type_size
        tensors.append(GgufTensor(name, dims, kind, data_offset + offset, elements, n_bytes, mapped))
    return GgufLayout(version, fields, tensors, data_offset)


def _tensor_entry(cursor: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string(f"tensor {index}'s name")
    n_dims = cursor.scalar("I", f"tensor {name!r}'s dimension count")
    if n_dims > MAX_DIMS:
        raise LmpressInputError(f"{cursor.file}: tensor {name!r} claims {n_dims} dimensions; ggml has at most 4")
    dims = tuple(cursor.scalar("Q", f"tensor {name!r}'s shape") for _ in range(n_dims))
    return name, dims, cursor.scalar("I", f"tensor {name!r}'s type"), cursor.scalar("Q", f"tensor {name!r}'s offset")
