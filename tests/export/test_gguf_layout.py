"""lmpress's GGUF header parser (lmpress.export.gguf_layout) against gguf-py's reader, the reference, on the files
lmpress writes and on one with every metadata value type and several tensor types; damaged headers refused."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from lmpress.errors import LmpressInputError
from lmpress.export.gguf_layout import read_gguf_layout


def assert_reads_as_gguf_py(file: Path, nested: tuple[str, ...] = ()) -> None:
    """Every field and tensor as gguf-py reads them, but the arrays of arrays in ``nested``: gguf-py's
    ``contents()`` flattens those, lmpress keeps them nested."""
    layout = read_gguf_layout(file)
    reference = gguf.GGUFReader(str(file))
    expected = {key: field.contents() for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    mine = {key: value for key, value in layout.fields.items() if key not in nested}
    assert mine == {key: value for key, value in expected.items() if key not in nested}
    assert [type(v) for v in mine.values()] == [type(v) for k, v in expected.items() if k not in nested]
    for key in nested:
        assert [x for inner in layout.fields[key] for x in inner] == expected[key]
    assert layout.data_offset == reference.data_offset
    assert len(layout.tensors) == len(reference.tensors)
    for mine, theirs in zip(layout.tensors, reference.tensors, strict=True):
        assert (mine.name, mine.shape, mine.tensor_type) == (
            theirs.name,
            tuple(theirs.shape.tolist()),
            theirs.tensor_type,
        )
        assert (mine.data_offset, mine.n_elements, mine.n_bytes) == (
            theirs.data_offset,
            theirs.n_elements,
            theirs.n_bytes,
        )
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_the_gguf_lmpress_writes_reads_as_gguf_py_reads_it(tiny_llama_dir, tmp_path):
    from lmpress.export.gguf import export_gguf
    from tests.export.conftest import rtn_quantizer

    model, tokenizer = rtn_quantizer(tiny_llama_dir, tmp_path)(bits=4, group_size=32)
    export_gguf(model, tokenizer, tmp_path / "gguf")
    assert_reads_as_gguf_py(tmp_path / "gguf" / "model.gguf")


@pytest.fixture
def every_value_type(tmp_path) -> Path:
    """A GGUF file gguf-py writes with each metadata value type, arrays of numbers, strings and arrays, a custom
    alignment, and F32 / F16 / I32 / Q8_0 tensors."""
    path = tmp_path / "every.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    kinds = gguf.GGUFValueType
    for name, value, kind in [
        ("u8", 200, kinds.UINT8), ("i8", -100, kinds.INT8), ("u16", 60000, kinds.UINT16),
        ("i16", -30000, kinds.INT16), ("u32", 4_000_000_000, kinds.UINT32), ("i32", -2_000_000_000, kinds.INT32),
        ("f32", 0.1, kinds.FLOAT32), ("bool", True, kinds.BOOL), ("u64", 2**63, kinds.UINT64),
        ("i64", -(2**62), kinds.INT64), ("f64", 0.1, kinds.FLOAT64), ("text", "héllo wörld", kinds.STRING),
    ]:  # fmt: skip
        writer.add_key_value(f"test.{name}", value, kind)
    writer.add_array("test.floats", [0.5, -1.25, 3.0])
    writer.add_array("test.ints", list(range(1000)))
    writer.add_array("test.strings", ["", "a", "ü" * 40] * 100)
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_array("test.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 5, 32)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_and_tensor_type_reads_as_gguf_py_reads_it(every_value_type):
    assert_reads_as_gguf_py(every_value_type, nested=("test.nested",))
    layout = read_gguf_layout(every_value_type)
    assert layout.fields["test.nested"] == [[1, 2], [3]] and layout.fields["test.text"] == "héllo wörld"
    assert layout.data_offset % 64 == 0


def damage(file: Path, offset: int, value: bytes) -> Path:
    data = bytearray(file.read_bytes())
    data[offset : offset + len(value)] = value
    file.write_bytes(bytes(data))
    return file


def first_field_offset(file: Path, key: str) -> int:
    return gguf.GGUFReader(str(file)).fields[key].offset


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("array-count", "runs past the end of the file"),
        ("string-array-count", "runs past the end of the file"),
        ("not-utf8", "is not UTF-8"),
        ("alignment", "not a power of two"),
        ("big-endian", "big-endian"),
        ("cut-in-the-table", "runs past the end of the file"),
    ],
)
def test_a_damaged_header_is_one_line_naming_what(every_value_type, case, fragment):
    file = every_value_type
    if case in ("array-count", "string-array-count"):  # key length, key, value type, element type, then the count
        key = "test.ints" if case == "array-count" else "test.strings"
        damage(file, first_field_offset(file, key) + 8 + len(key) + 4 + 4, struct.pack("<Q", 2**40))
    elif case == "not-utf8":
        damage(file, first_field_offset(file, "test.text") + 8 + len("test.text") + 4 + 8, b"\xff")
    elif case == "alignment":  # general.alignment's value: 48
        damage(file, first_field_offset(file, "general.alignment") + 8 + len("general.alignment") + 4, b"\x30")
    elif case == "big-endian":
        damage(file, 4, struct.pack(">I", 3))
    else:
        file.write_bytes(file.read_bytes()[: gguf.GGUFReader(str(file)).tensors[1].field.offset + 5])
    with pytest.raises(LmpressInputError, match=fragment) as refused:
        read_gguf_layout(file)
    assert "\n" not in str(refused.value) and str(file) in str(refused.value)
