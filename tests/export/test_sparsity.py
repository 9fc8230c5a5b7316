"""Pruned models in compressed-tensors (sparsity_config) and in ``lmpress inspect``."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmpress.data import calibration_samples, load_text, tokenize
from lmpress.export.formats import quantized_layers
from lmpress.export.inspect import inspect_artifact
from lmpress.export.inspect_render import render_inspect_text
from lmpress.prune.sparsegpt import SparseGPTConfig, run_sparsegpt
from lmpress.prune.wanda import WandaConfig, run_wanda
from lmpress.registry import StageContext
from tests.export.test_compressed_tensors import _decompress_with_compressed_tensors


@pytest.fixture
def pruned_tiny(tiny_llama_dir, tmp_path):
    def prune(run, config):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
        calibration = calibration_samples(tokenize(tokenizer, load_text("builtin:python-docs")), 8, 32, seed=0)
        ctx = StageContext(calibration=lambda: calibration, state_dir=tmp_path / "s", resume=False, fingerprint="x")
        run(model, config, ctx)
        return model, tokenizer

    return prune


def test_24_w4_export_keeps_its_zeros_in_the_codes_with_no_sparsity_config(pruned_tiny, export):
    """vLLM 0.32 refuses a compressed-tensors checkpoint whose sparsity_config names targets, so the export
    writes none; the 2:4 zeros are in the decompressed weights and ``inspect`` reads the pattern from them."""
    pytest.importorskip("compressed_tensors")

    config = SparseGPTConfig(pattern="2:4", quantize={"bits": 4, "group_size": 32}, ignore=["lm_head"])
    model, tokenizer = pruned_tiny(run_sparsegpt, config)
    out = export("compressed-tensors", model, tokenizer)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["sparsity_config"] == {}
    weights = _decompress_with_compressed_tensors(out)
    layers = quantized_layers(model)
    assert set(weights) == set(layers)
    for name, module in layers.items():
        assert torch.equal(weights[name], module.dequantized_weight()), name
        assert ((weights[name].reshape(weights[name].shape[0], -1, 4) == 0).sum(-1) >= 2).all(), name

    info = inspect_artifact(out)
    assert all(row["pattern"] == "2:4" and row["sparsity"] >= 0.5 for row in info["layers"])
    assert "(2:4)" in render_inspect_text(info)


def test_unpruned_export_has_no_sparsity_config(quantized_tiny, export):
    model, tokenizer = quantized_tiny(bits=4, group_size=32)
    out = export("compressed-tensors", model, tokenizer)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["sparsity_config"] == {}


def test_inspect_shows_the_sparsity_of_each_layer_of_a_dense_checkpoint(pruned_tiny, export):
    model, tokenizer = pruned_tiny(run_wanda, WandaConfig(sparsity=0.5, overrides={".*mlp.*": {"sparsity": 0.25}}))
    info = inspect_artifact(export("hf", model, tokenizer))
    rows = {row["name"]: row for row in info["sparse_layers"]}
    assert len(rows) == 14
    assert rows["model.layers.0.self_attn.q_proj"]["sparsity"] == 0.5
    assert rows["model.layers.1.mlp.down_proj"]["sparsity"] == 0.25
    # per layer: q, o 128x128 and k, v 64x128 at 50%; gate, up 256x128 and down 128x256 at 25%
    attention, mlp = 2 * 128 * 128 + 2 * 64 * 128, 3 * 256 * 128
    assert info["sparsity"] == pytest.approx((attention * 0.5 + mlp * 0.25) / (attention + mlp), abs=1e-12)
    assert "sparsity per layer" in render_inspect_text(info)
