from __future__ import annotations

import copy

import pytest
import torch

from lmpress.anatomy import decoder_layers
from lmpress.data import calibration_samples, load_text, tokenize
from lmpress.loader import load_model
from lmpress.metrics import exact_kld
from lmpress.prune.depth_kl import greedy_kl_layer_drop
from lmpress.prune.structured import StructuredConfig, remove_layers, repeated_halves, run_structured
from lmpress.registry import StageContext, stage_handler_for
from tests.conftest import save_tiny_model


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    loaded = load_model(str(save_tiny_model(tmp_path_factory.mktemp("five"), "llama", num_hidden_layers=5)))
    samples = calibration_samples(tokenize(loaded.tokenizer, load_text("builtin:python-docs")), 3, 24, seed=0)
    return loaded, samples


def kl_without(model, samples, drop: list[int]) -> float:
    """The reference: a copy with the layers really removed, run whole, one sample at a time."""
    with torch.no_grad():
        smaller = copy.deepcopy(model)
        remove_layers(smaller, drop)
        total = 0.0
        for row in samples:
            reference = model(row[None]).logits.float().log_softmax(-1)
            total += float(exact_kld(reference, smaller(row[None]).logits.float().log_softmax(-1)).mean())
    return total / len(samples)


def test_each_round_removes_the_layer_a_full_rerun_finds_cheapest(five_layers):
    loaded, samples = five_layers
    model = loaded.model
    drop, trace = greedy_kl_layer_drop(model, samples, 2)

    removed: list[int] = []
    for score in trace:
        left = [i for i in range(5) if i not in removed]
        costs = {i: kl_without(model, samples, removed + [i]) for i in left}
        best = min(costs, key=costs.get)
        assert costs[best] == pytest.approx(score, rel=1e-4, abs=1e-6)
        removed.append(best)
    assert drop == sorted(removed)
    assert trace[0] <= trace[1]


def test_the_model_is_left_as_it_was(five_layers):
    loaded, samples = five_layers
    model = loaded.model
    layers_before = list(decoder_layers(model))
    with torch.no_grad():
        before = model(samples).logits
    greedy_kl_layer_drop(model, samples, 3)
    assert list(decoder_layers(model)) == layers_before
    with torch.no_grad():
        torch.testing.assert_close(model(samples).logits, before, rtol=0, atol=0)


def test_the_structured_stage_removes_by_kl(five_layers, tmp_path):
    loaded, samples = five_layers
    model = copy.deepcopy(loaded.model)
    # layer 3 writes nothing into the residual stream: removing it changes no output
    decoder_layers(model)[3].self_attn.o_proj.weight.data.zero_()
    decoder_layers(model)[3].mlp.down_proj.weight.data.zero_()
    ctx = StageContext(calibration=lambda: samples, state_dir=tmp_path, resume=False, fingerprint="f")
    summary = run_structured(model, StructuredConfig(layers=2, layer_importance="kl", kl_samples=2), ctx)
    assert 3 in summary["removed_layers"] and len(summary["removed_layers"]) == 2
    assert summary["kl_after_each_removal"][0] == pytest.approx(0.0, abs=1e-6)
    assert model.config.num_hidden_layers == 3


def test_repeated_halves_score_on_the_text_and_its_repeat(five_layers, tmp_path):
    loaded, samples = five_layers
    doubled = repeated_halves(samples)
    assert doubled.shape == samples.shape
    assert torch.equal(doubled[:, :12], samples[:, :12]) and torch.equal(doubled[:, 12:], samples[:, :12])
    # the stage scores on those rows: the same choice and KL as the criterion run on them directly
    model = copy.deepcopy(loaded.model)
    want, trace = greedy_kl_layer_drop(model, doubled[:2], 2)
    ctx = StageContext(calibration=lambda: samples, state_dir=tmp_path, resume=False, fingerprint="f")
    config = StructuredConfig(layers=2, layer_importance="kl", kl_samples=2, kl_repeat=True)
    summary = stage_handler_for(config)(model, config, ctx)  # as the pipeline calls it
    assert summary["removed_layers"] == want and summary["kl_repeat"] is True
    assert summary["kl_after_each_removal"] == [round(k, 5) for k in trace]
