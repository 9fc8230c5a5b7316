"""A corruption corpus: damaged exports (copied out of their run, and inside it) through ``lmpress inspect``,
``inspect --verify`` and ``lmpress generate``. Each is exit 2 with one line naming the file; none is silent."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lmpress.cli import main
from lmpress.export.manifest import write_manifest

pytestmark = pytest.mark.usefixtures("private_cache")


def read_header(file: Path) -> tuple[dict, bytes]:
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data


def rewrite_header(file: Path, edit: Callable[[dict], None]) -> None:
    """Edit a safetensors header in place, keeping its length (padded with spaces, as the format allows)."""
    header, data = read_header(file)
    (length,) = struct.unpack("<Q", data[:8])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length, "the edit must not lengthen the header"
    file.write_bytes(data[:8] + text.ljust(length) + data[8 + length :])


def first_key(header: dict, suffix: str) -> str:
    return next(k for k in sorted(header) if k.endswith(suffix))


def nan_scales(out: Path) -> None:
    """Overwrite one scale tensor's bytes with NaN, leaving the header as it was."""
    file = out / "model.safetensors"
    header, data = read_header(file)
    key = first_key(header, "weight_scale")
    entry = header[key]
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[entry["dtype"]]
    nan = torch.full(entry["shape"], float("nan"), dtype=dtype).view(torch.uint8).numpy().tobytes()
    start = 8 + struct.unpack("<Q", data[:8])[0] + entry["data_offsets"][0]
    file.write_bytes(data[:start] + nan + data[start + len(nan) :])


def overlapping(out: Path) -> None:
    """Two tensors of one size made to share their bytes (the later one pointed at the earlier one's)."""

    def edit(header: dict) -> None:
        k, v = first_key(header, "k_proj.weight_scale"), first_key(header, "v_proj.weight_scale")
        earlier, later = sorted((k, v), key=lambda key: header[key]["data_offsets"][0])
        header[later]["data_offsets"] = list(header[earlier]["data_offsets"])

    rewrite_header(out / "model.safetensors", edit)


def wrong_shape(out: Path) -> None:
    def edit(header: dict) -> None:
        key = first_key(header, "q_proj.weight_packed")
        header[key]["shape"][0] -= 1

    rewrite_header(out / "model.safetensors", edit)


def one_layer_more(out: Path) -> None:
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (out / "config.json").write_text(json.dumps(config))


def header_past_the_end(out: Path) -> None:
    file = out / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(struct.pack("<Q", 2**40) + data[8:])


def truncated(out: Path) -> None:
    file = next(out.glob("*.safetensors")) if list(out.glob("*.safetensors")) else next(out.glob("*.gguf"))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) * 3 // 5])


def gguf_bytes(out: Path, offset: int, value: bytes) -> None:
    file = out / "model.gguf"
    data = bytearray(file.read_bytes())
    data[offset : offset + len(value)] = value
    file.write_bytes(bytes(data))


def gguf_first_value_type(out: Path, value: bytes) -> None:
    """``value`` over the type of the first metadata entry (after its 8-byte key length and its key)."""
    key_length = struct.unpack_from("<Q", (out / "model.gguf").read_bytes(), 24)[0]
    gguf_bytes(out, 24 + 8 + key_length, value)


def gguf_tensor_entry(out: Path, part: int, value: bytes) -> None:
    """``value`` over part ``part`` of the first tensor's entry (0 name length, 1 name, 2 dimension count, 3 shape,
    4 type, 5 offset), found by gguf-py's reader."""
    import gguf

    field = gguf.GGUFReader(str(out / "model.gguf")).tensors[0].field
    gguf_bytes(out, field.offset + sum(int(p.nbytes) for p in field.parts[:part]), value)


CHECKPOINT_DAMAGE = {
    "nan-scales": (nan_scales, "NaN or infinite"),
    "overlapping-tensors": (overlapping, "overlap"),
    "shape-against-bytes": (wrong_shape, "should take"),
    "config-one-layer-more": (one_layer_more, "decoder layers"),
    "header-length-past-the-end": (header_past_the_end, "not a readable safetensors file"),
    "truncated": (truncated, "past the end of the file"),
}
GGUF_DAMAGE = {
    "magic": (lambda out: gguf_bytes(out, 0, b"GGML"), "not a GGUF file"),
    "version": (lambda out: gguf_bytes(out, 4, struct.pack("<I", 99)), "GGUF version 99"),
    "2^40-tensors": (lambda out: gguf_bytes(out, 8, struct.pack("<Q", 2**40)), "more than a"),
    "truncated": (truncated, "model.gguf"),
    "key-length-past-the-end": (lambda out: gguf_bytes(out, 24, struct.pack("<Q", 2**40)), "past the end of the file"),
    "unknown-value-type": (lambda out: gguf_first_value_type(out, struct.pack("<I", 99)), "value type 99"),
    "unknown-tensor-type": (lambda out: gguf_tensor_entry(out, 4, struct.pack("<I", 99)), "type 99"),
    "nine-dimensions": (lambda out: gguf_tensor_entry(out, 2, struct.pack("<I", 9)), "9 dimensions"),
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_llama_dir):
    """The tiny model's W4 g32 compressed-tensors and GGUF exports, and its dense hf export (module-scoped)."""
    from lmpress.registry import exporter
    from tests.export.conftest import rtn_quantizer

    tmp = tmp_path_factory.mktemp("artifact-checks")
    model, tokenizer = rtn_quantizer(tiny_llama_dir, tmp)(bits=4, group_size=32)
    out = {}
    for fmt in ("compressed-tensors", "gguf", "hf"):
        out[fmt] = tmp / fmt
        out[fmt].mkdir()
        exporter(fmt)(model, tokenizer, out[fmt])
    return out


def assert_refused(argv: list[str], fragment: str, capsys) -> None:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, f"{argv[0]} exited {code} on a damaged export: {err}"
    assert len(err.splitlines()) == 1 and fragment in err and "Traceback" not in err, err


def damaged_copy(source: Path, tmp_path: Path, damage: Callable[[Path], None]) -> Path:
    out = Path(shutil.copytree(source, tmp_path / "copied-out"))
    damage(out)
    return out


GENERATE = ["--prompt", "def f(x):", "--max-new-tokens", "2"]


@pytest.mark.parametrize("case", sorted(CHECKPOINT_DAMAGE))
def test_damaged_compressed_tensors_export_is_refused_by_inspect_and_generate(exports, tmp_path, capsys, case):
    damage, fragment = CHECKPOINT_DAMAGE[case]
    out = damaged_copy(exports["compressed-tensors"], tmp_path, damage)
    assert_refused(["inspect", str(out)], fragment, capsys)
    assert_refused(["inspect", "--verify", str(out)], fragment, capsys)
    assert_refused(["generate", str(out), *GENERATE], fragment, capsys)


@pytest.mark.parametrize("case", sorted(GGUF_DAMAGE))
def test_damaged_gguf_is_refused_by_inspect_and_generate(exports, tmp_path, capsys, case):
    damage, fragment = GGUF_DAMAGE[case]
    out = damaged_copy(exports["gguf"], tmp_path, damage)
    assert_refused(["inspect", str(out / "model.gguf")], fragment, capsys)
    assert_refused(["generate", str(out), *GENERATE], fragment, capsys)


def test_whole_exports_pass_every_check_and_inspect_summarises_the_gguf(exports, capsys):
    for fmt in ("compressed-tensors", "gguf", "hf"):
        assert main(["inspect", "--verify", str(exports[fmt])]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["inspect", "--json", str(exports["gguf"])]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "Q4_0" in info["tensor_types"] and info["metadata"]["general.architecture"] == "llama"
    assert info["tensors"] == len(info["gguf_tensors"]) == sum(info["tensor_types"].values())
    q = next(r for r in info["gguf_tensors"] if r["name"] == "blk.0.attn_q.weight")
    assert q["type"] == "Q4_0" and q["block_size"] == 32 and q["bits_per_weight"] == 4.5


def test_a_nan_weight_passes_the_cheap_checks_and_fails_verify(exports, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    out = Path(shutil.copytree(exports["hf"], tmp_path / "hf"))
    tensors = load_file(out / "model.safetensors")
    key = next(k for k in sorted(tensors) if k.endswith("mlp.up_proj.weight"))
    tensors[key][0, 0] = float("inf")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert main(["inspect", str(out)]) == 0  # the cheap pass reads scales, not every weight
    capsys.readouterr()
    assert_refused(["inspect", "--verify", str(out)], key, capsys)


def test_a_run_folder_lists_every_export_and_inspect_checks_its_manifest(exports, tmp_path, capsys):
    run = tmp_path / "run"
    for fmt in ("compressed-tensors", "gguf"):
        shutil.copytree(exports[fmt], run / fmt)
    write_manifest(run, recipe={}, metrics={})
    assert main(["inspect", "--json", str(run)]) == 0
    formats = sorted(a["format"] for a in json.loads(capsys.readouterr().out)["artifacts"])
    assert formats == ["compressed-tensors", "gguf"]
    nan_scales(run / "compressed-tensors")  # inside the run the manifest names the changed file first
    assert_refused(["inspect", str(run)], "does not match", capsys)
    assert_refused(["inspect", str(run / "compressed-tensors")], "does not match", capsys)
    assert_refused(["generate", str(run / "compressed-tensors"), *GENERATE], "does not match", capsys)


def test_layers_sort_in_natural_order():
    from lmpress.export.inspect import natural_key

    names = ["model.layers.10.mlp", "model.layers.2.mlp", "model.layers.1.mlp", "lm_head"]
    assert sorted(names, key=natural_key) == [
        "lm_head",
        "model.layers.1.mlp",
        "model.layers.2.mlp",
        "model.layers.10.mlp",
    ]
