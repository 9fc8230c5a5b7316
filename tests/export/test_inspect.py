"""inspect_artifact / render_inspect, and damaged checkpoints as clear input errors."""

import shutil

import pytest

from lmpress.errors import LmpressInputError
from lmpress.export.formats import load_quantized_checkpoint
from lmpress.export.inspect import inspect_artifact
from lmpress.export.inspect_render import render_inspect_text


def test_gptq_checkpoint_summary(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32, overrides={".*down_proj": {"bits": 8}})
    out = export("gptq", model, tokenizer)
    info = inspect_artifact(out)
    assert info["format"] == "gptq" and info["checkpoint_format"] == "gptq"
    assert info["bits"] == [4, 8] and info["group_size"] == 32 and info["sym"] is True
    assert info["act_order"] is False and info["quantized_layers"] == 14
    assert info["size_bytes"] == sum(p.stat().st_size for p in out.iterdir())
    down = next(r for r in info["layers"] if r["name"] == "model.layers.0.mlp.down_proj")
    assert down["shape"] == [128, 256] and down["bits"] == 8
    # 8-bit codes + float16 scale and packed zero per 32 weights + int32 g_idx per input column
    assert down["bytes"] == 128 * 256 + 8 * 128 * 2 + 8 * 128 + 256 * 4
    text = render_inspect_text(info)
    assert "gptq" in text and "model.layers.1.self_attn.q_proj" in text and "size on disk" in text


def test_run_directory_and_dense_checkpoint(quantized_tiny, export, tmp_path):
    model, tokenizer = quantized_tiny(bits=4, group_size=64, symmetric=False)
    run = tmp_path / "run"
    run.mkdir()
    for fmt in ("awq", "compressed-tensors", "hf"):
        shutil.move(export(fmt, model, tokenizer), run / fmt)
    info = inspect_artifact(run)
    assert info["format"] == "run"
    formats = {a["format"]: a for a in info["artifacts"]}
    assert set(formats) == {"awq", "compressed-tensors", "hf"}
    assert formats["awq"]["bits"] == 4 and formats["awq"]["sym"] is False
    assert formats["compressed-tensors"]["group_size"] == 64
    assert formats["hf"]["quantized_layers"] == 0 and formats["hf"]["parameters"] > 0
    text = render_inspect_text(info)
    assert text.count("size on disk") == 3


def test_missing_paths_and_non_checkpoints_are_input_errors(tmp_path):
    with pytest.raises(LmpressInputError, match="no such file"):
        inspect_artifact(tmp_path / "nope")
    with pytest.raises(LmpressInputError, match="neither a checkpoint"):
        inspect_artifact(tmp_path)


@pytest.mark.parametrize("fmt", ["gptq", "hf"])
@pytest.mark.parametrize("damage", ["truncate", "garble_header", "empty"])
def test_damaged_safetensors_is_a_one_line_input_error(quantized_tiny, export, damage, fmt):
    model, tokenizer = quantized_tiny(bits=4, group_size=32)
    out = export(fmt, model, tokenizer)
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "garble_header":
        weights.write_bytes(data[:8] + b"{not json" + data[17:])
    else:
        weights.write_bytes(b"")
    for read in (load_quantized_checkpoint, inspect_artifact) if fmt == "gptq" else (inspect_artifact,):
        with pytest.raises(LmpressInputError) as info:
            read(out)
        message = str(info.value)
        assert "model.safetensors" in message and "\n" not in message


def test_inconsistent_tensors_are_input_errors(quantized_tiny, export):
    from safetensors.torch import load_file, save_file

    model, tokenizer = quantized_tiny(bits=4, group_size=32)
    out = export("gptq", model, tokenizer)
    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.qzeros"]
    tensors["model.layers.1.mlp.up_proj.scales"] = tensors["model.layers.1.mlp.up_proj.scales"][:1].clone()
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(LmpressInputError, match=r"no tensor 'model.layers.0.mlp.up_proj.qzeros'|has shape"):
        load_quantized_checkpoint(out)
