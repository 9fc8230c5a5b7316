"""Structured pruning: the smaller model's config, its checkpoint in transformers, importance ranking."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmpress.anatomy import decoder_layers
from lmpress.data import calibration_samples, load_text, tokenize
from lmpress.errors import LmpressInputError
from lmpress.loader import load_model
from lmpress.prune.structured import StructuredConfig, prune_kv_groups, run_structured
from lmpress.registry import StageContext, exporter
from tests.conftest import save_tiny_model


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("deep-llama"), "llama", num_hidden_layers=4)


def context(tmp_path, tokenizer) -> StageContext:
    calibration = calibration_samples(tokenize(tokenizer, load_text("builtin:python-docs")), 8, 32, seed=0)
    return StageContext(calibration=lambda: calibration, state_dir=tmp_path / "state", resume=False, fingerprint="f")


def test_pruned_checkpoint_loads_in_transformers_and_matches_lmpress(deep_llama_dir, tmp_path):
    loaded = load_model(str(deep_llama_dir))
    model = loaded.model
    config = StructuredConfig(mlp_channels=0.25, heads=2, layers=1)
    summary = run_structured(model, config, context(tmp_path, loaded.tokenizer))
    assert len(summary["removed_layers"]) == 1
    assert summary["parameters_after"] < summary["parameters_before"]
    assert (model.config.num_hidden_layers, model.config.intermediate_size) == (3, 192)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim) == (2, 1, 32)
    layer = decoder_layers(model)[0]
    assert layer.self_attn.q_proj.weight.shape == (64, 128) and layer.self_attn.k_proj.weight.shape == (32, 128)
    assert layer.mlp.down_proj.weight.shape == (128, 192)

    exporter("hf")(model, loaded.tokenizer, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    params = sum(p.numel() for p in reloaded.parameters())
    assert params == summary["parameters_after"]
    ids = calibration_samples(tokenize(loaded.tokenizer, load_text("builtin:python-docs")), 2, 48, seed=3)
    with torch.no_grad():
        want = model(ids).logits
        got = reloaded(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # with a KV cache too (the renumbered layers index their cache slots)
    with torch.no_grad():
        generated = reloaded.generate(ids[:1, :8], max_new_tokens=6, do_sample=False)
        step = model.generate(ids[:1, :8], max_new_tokens=6, do_sample=False)
    assert torch.equal(generated, step)


def test_the_forecast_s_skeleton_takes_the_shapes_the_stage_leaves(deep_llama_dir, tmp_path):
    """``reshape_skeleton`` on the meta skeleton gives every tensor the shape the stage gives it on real weights."""
    from lmpress.loader import model_skeleton
    from lmpress.memory_plan import skeleton_after

    config = StructuredConfig(mlp_channels=0.25, heads=2, layers=1)
    loaded = load_model(str(deep_llama_dir))
    run_structured(loaded.model, config, context(tmp_path, loaded.tokenizer))
    skeleton = model_skeleton(deep_llama_dir)
    reshaped = skeleton_after(skeleton, [config])
    assert len(decoder_layers(skeleton)) == 4  # the skeleton itself is left as loaded (the baseline's model)
    shapes = {name: tuple(t.shape) for name, t in reshaped.state_dict().items()}
    assert shapes == {name: tuple(t.shape) for name, t in loaded.model.state_dict().items()}
    assert reshaped.config.to_dict() == loaded.model.config.to_dict()


def test_the_least_changing_layer_goes_first(deep_llama_dir, tmp_path):
    loaded = load_model(str(deep_llama_dir))
    model = loaded.model
    # layer 2 becomes (almost) the identity: its output projections write nothing into the residual stream
    decoder_layers(model)[2].self_attn.o_proj.weight.data.zero_()
    decoder_layers(model)[2].mlp.down_proj.weight.data.zero_()
    summary = run_structured(model, StructuredConfig(layers=1), context(tmp_path, loaded.tokenizer))
    assert summary["removed_layers"] == [2]
    assert summary["angular_distance"][2] == pytest.approx(0.0, abs=1e-3)


def test_the_weakest_channels_and_gqa_groups_go():
    from torch import nn

    attention = nn.Module()
    for name, rows in (("q_proj", 4 * 8), ("k_proj", 2 * 8), ("v_proj", 2 * 8)):
        setattr(attention, name, nn.Linear(16, rows, bias=False))
    attention.o_proj = nn.Linear(32, 16, bias=False)
    q = attention.q_proj.weight.data.clone()
    prune_kv_groups(attention, torch.tensor([1]), group=2, head_dim=8)
    assert torch.equal(attention.q_proj.weight, q[16:])  # query heads 2, 3 read KV head 1
    assert attention.o_proj.weight.shape == (16, 16)


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"heads": 4}, "removes every one of the 4 attention heads"),
        ({"heads": 1}, "breaks a GQA group"),
        ({"layers": 2}, "removes every one of the model's 2 decoder layers"),
    ],
)
def test_impossible_removals_are_refused(tiny_llama_dir, settings, fragment):
    model = load_model(str(tiny_llama_dir)).model
    with pytest.raises(LmpressInputError, match=fragment):
        StructuredConfig(**settings).check(model)


def test_a_structured_recipe_runs_end_to_end(deep_llama_dir, tmp_path, monkeypatch):
    import json

    import yaml

    from lmpress.cli import main

    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path / "cache"))
    recipe = {
        "model": str(deep_llama_dir),
        "data": {"source": "builtin:python-docs", "samples": 4, "seq_len": 64},
        "stages": [{"method": "structured", "layers": 1, "heads": 2, "mlp_channels": 0.25}],
        "export": {"formats": ["hf"]},
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 2}},
        "gates": ["ppl_ratio <= 1000"],
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    out = tmp_path / "run"
    assert main(["run", str(tmp_path / "recipe.yaml"), "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "report.json").read_text())["stages"][0]["summary"]
    assert summary["num_hidden_layers"] == 3 and summary["parameters_after"] < summary["parameters_before"]
    config = json.loads((out / "hf" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["intermediate_size"]) == (3, 2, 192)
