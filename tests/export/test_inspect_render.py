"""inspect's tables at the widths people read them: every layer named in full, or under its block, never cut."""

import pytest

from lmpress.export.inspect import inspect_artifact
from lmpress.export.inspect_render import render_inspect_text


def _layer_names(info):
    return [r["name"] for r in info["layers"]]


@pytest.mark.parametrize("width", [80, 100])
def test_narrow_consoles_list_every_layer_under_its_block(quantized_tiny, export, width):
    model, tokenizer = quantized_tiny(bits=4, group_size=32, overrides={".*down_proj": {"bits": 8}})
    info = inspect_artifact(export("gptq", model, tokenizer))
    text = render_inspect_text(info, width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    for name in _layer_names(info):
        block, leaf = name.rsplit(".", 2)[0], ".".join(name.split(".")[-2:])
        assert name in text or (
            any(line.strip() == block for line in lines) and any(line.strip().startswith(leaf + " ") for line in lines)
        ), name
    # a row per layer keeps its own numbers: the 8-bit down_proj's size and the 4-bit q_proj's
    for r in info["layers"]:
        assert f"{r['bytes'] / 1e3:.1f} kB" in text
    # what every layer shares is said once: group 32, symmetric, no act-order
    assert "every row: group 32, sym yes, act-order no" in " ".join(text.split())


def test_wide_consoles_keep_full_names_for_grep(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32, overrides={".*down_proj": {"bits": 8}})
    info = inspect_artifact(export("gptq", model, tokenizer))
    text = render_inspect_text(info, 160)
    for name in _layer_names(info):
        assert any(line.split() and line.split()[0] == name for line in text.splitlines()), name
    rows = [line.split()[0] for line in text.splitlines() if line.split() and line.split()[0] in _layer_names(info)]
    assert rows.index("model.layers.1.self_attn.q_proj") > rows.index("model.layers.0.mlp.down_proj")


def test_very_narrow_consoles_wrap_values_rather_than_cut_them(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32, overrides={".*down_proj": {"bits": 8}})
    info = inspect_artifact(export("gptq", model, tokenizer))
    text = render_inspect_text(info, 56)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 56
    leaves = [line.strip() for line in text.splitlines()]
    assert all(any(leaf.startswith(name.split(".", 3)[3]) for leaf in leaves) for name in _layer_names(info))
