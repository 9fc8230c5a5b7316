"""Learned rounding: the fake-quant's grid, freezing into the packed form, block error below RTN, exports, resume."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pydantic
import pytest
import torch
import yaml

from lmpress.anatomy import decoder_layers, get_anatomy, layer_linears
from lmpress.calib.engine import capture_first_layer_inputs, expand_groups
from lmpress.calib.session import LayerSession
from lmpress.cli import main
from lmpress.data import calibration_samples, load_text, tokenize
from lmpress.loader import load_model
from lmpress.quantize.learned_rounding import (
    LearnedRoundingConfig,
    LearnedRoundingMethod,
    block_output,
    run_learned,
    summed_over_samples,
)
from lmpress.quantize.learned_rounding_quantize import (
    CLIP_RANGE,
    V_RANGE,
    Rounding,
)
from lmpress.registry import StageContext
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import quantize_weight_rtn
from tests.conftest import save_tiny_model
from tests.prune.test_unstructured import run_killed_then_resumed


def test_full_range_needs_a_symmetric_scheme():
    with pytest.raises(pydantic.ValidationError, match="full_range is a symmetric grid"):
        LearnedRoundingConfig(symmetric=False, full_range=True)


def test_ranges_of_the_options_are_checked():
    for bad in ({"lr": 0}, {"lr": 1.5}, {"iterations": 0}, {"iterations": 10**6}, {"batch_size": 0}, {"init": "x"}):
        with pytest.raises(pydantic.ValidationError):
            LearnedRoundingConfig(**bad)
    with pytest.raises(pydantic.ValidationError):
        LearnedRoundingConfig(bits=5)
    assert LearnedRoundingConfig(iterations=50).step_size == pytest.approx(1 / 50)
    assert LearnedRoundingConfig(lr=0.01).step_size == 0.01


# On a tiny model ---------------------------------------------------------------------------------


def calibration_for(tokenizer, n: int = 8, seq_len: int = 32) -> torch.Tensor:
    return calibration_samples(tokenize(tokenizer, load_text("builtin:python-docs")), n, seq_len, seed=0)


def layer0_session(model, calibration, config) -> LayerSession:
    inputs = capture_first_layer_inputs(model, calibration.split(4), device=torch.device("cpu"))
    layer = decoder_layers(model)[0]
    targets = {n: config.scheme_for(f"model.layers.0.{n}") for n in layer_linears(layer)}
    groups = expand_groups(get_anatomy(model), targets)
    return LayerSession(0, layer, "model.layers.0.", targets, groups, inputs, torch.device("cpu"), model=model)


@torch.no_grad()
def layer_outputs(session: LayerSession) -> torch.Tensor:
    return torch.cat([session.layer(hidden, **kwargs)[0] for hidden, kwargs in session.batches()])


@pytest.mark.long
@pytest.mark.parametrize("init", ["rtn", "awq", "gptq", "awq+gptq"])
def test_learned_block_output_error_is_below_rtn(tiny_llama_dir, init):
    loaded = load_model(str(tiny_llama_dir))
    config = LearnedRoundingConfig(bits=3, group_size=32, iterations=40, batch_size=4, init=init)
    session = layer0_session(loaded.model, calibration_for(loaded.tokenizer), config)
    reference = layer_outputs(session)
    originals = {n: session.linear(n).weight.data.clone() for n in session.targets}

    for name, scheme in session.targets.items():
        session.linear(name).weight.data = quantize_weight_rtn(originals[name], scheme).dequantize()
    rtn_error = torch.mean((layer_outputs(session) - reference) ** 2).item()
    for name, w in originals.items():
        session.linear(name).weight.data = w

    if init.startswith("awq"):
        from lmpress.quantize.learned_rounding import awq_scales_method

        awq = awq_scales_method(config)
        awq.prepare_layer(session)
        torch.testing.assert_close(layer_outputs(session), reference, rtol=1e-4, atol=1e-4)  # scales fold exactly
    method = LearnedRoundingMethod(config)
    method.prepare_layer(session)
    assert set(session.quantized) == set(session.targets)
    learned_error = torch.mean((layer_outputs(session) - reference) ** 2).item()
    start_loss, relative = method.losses[0]
    assert start_loss > 0 and relative < 1
    assert learned_error < 0.8 * rtn_error, (learned_error, rtn_error)
    assert all(p.grad is None for p in session.layer.parameters())


def test_the_stage_quantizes_every_target_and_leaves_gradients_off(tiny_llama_dir, tmp_path):
    loaded = load_model(str(tiny_llama_dir))
    calibration = calibration_for(loaded.tokenizer)
    ctx = StageContext(calibration=lambda: calibration, state_dir=tmp_path / "s", resume=False, fingerprint="f")
    requires = {n: p.requires_grad for n, p in loaded.model.named_parameters()}
    summary = run_learned(loaded.model, LearnedRoundingConfig(bits=4, group_size=64, iterations=4), ctx)
    assert summary["quantized_linears"] == 14 and summary["mean_loss_ratio"] <= 1
    for layer in decoder_layers(loaded.model):
        assert not layer_linears(layer)  # no float linear left
        assert sum(isinstance(m, QuantizedLinear) for m in layer.modules()) == 7
    after = {n: p.requires_grad for n, p in loaded.model.named_parameters()}
    assert after and all(requires[n] == r for n, r in after.items())  # norms and embeddings as they were
    assert all(p.grad is None for p in loaded.model.parameters())


@pytest.mark.parametrize("reference", ["model", "layer"])
def test_each_block_is_trained_against_the_reference_it_names(tiny_llama_dir, tmp_path, monkeypatch, reference):
    import lmpress.quantize.learned_rounding as learned

    targets_seen = []

    def recording(block, weights, batch, targets, *args, **kwargs):
        targets_seen.append(targets[0].clone())
        return learn(block, weights, batch, targets, *args, **kwargs)

    learn = learned.learn_block_rounding
    monkeypatch.setattr(learned, "learn_block_rounding", recording)
    loaded = load_model(str(tiny_llama_dir))
    calibration = calibration_for(loaded.tokenizer)
    ctx = StageContext(calibration=lambda: calibration, state_dir=tmp_path / "s", resume=False, fingerprint="f")
    config = LearnedRoundingConfig(bits=2, group_size=32, iterations=2, batch_size=2, reference=reference)
    run_learned(loaded.model, config, ctx)
    assert len(targets_seen) == 2
    float_outputs = [_float_layer_output(tiny_llama_dir, calibration, i) for i in range(2)]
    # Layer 0 reads the same input in both models (rounded to float16 by the engine's activation store).
    torch.testing.assert_close(targets_seen[0], float_outputs[0], rtol=1e-2, atol=1e-2)
    error = torch.mean((targets_seen[1] - float_outputs[1]) ** 2) / torch.mean(float_outputs[1] ** 2)
    if reference == "model":
        assert error < 1e-5
    else:  # the float block on the 2-bit layer 0's output
        assert error > 1e-3


def _float_layer_output(model_dir: Path, calibration: torch.Tensor, index: int) -> torch.Tensor:
    """Decoder layer ``index``'s output in the unquantized model, for the first 2 calibration samples (a hook)."""
    loaded = load_model(str(model_dir))
    captured = []
    layer = decoder_layers(loaded.model)[index]
    handle = layer.register_forward_hook(lambda m, args, out: captured.append(block_output(out)))
    with torch.no_grad():
        loaded.model(calibration[:2])
    handle.remove()
    return captured[0].float()


def test_the_same_seed_gives_the_same_codes_and_another_seed_other_codes(tiny_llama_dir, tmp_path):
    def codes(seed: int) -> torch.Tensor:
        loaded = load_model(str(tiny_llama_dir))
        calibration = calibration_for(loaded.tokenizer, n=12)
        ctx = StageContext(calibration=lambda: calibration, state_dir=tmp_path / "s", resume=False, fingerprint="f")
        config = LearnedRoundingConfig(bits=3, group_size=32, iterations=12, batch_size=4, seed=seed)
        run_learned(loaded.model, config, ctx)
        linears = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
        assert len(linears) == 14
        return torch.cat([m.qweight.flatten() for m in linears])

    first = codes(0)
    assert torch.equal(first, codes(0))
    assert not torch.equal(first, codes(1))  # the seed orders the batches, so the path differs


def test_more_samples_than_the_calibration_holds_is_a_warning(tiny_llama_dir, tmp_path):
    loaded = load_model(str(tiny_llama_dir))
    calibration = calibration_for(loaded.tokenizer)
    ctx = StageContext(calibration=lambda: calibration, state_dir=tmp_path / "s", resume=False, fingerprint="f")
    summary = run_learned(loaded.model, LearnedRoundingConfig(iterations=1, samples=100, group_size=64), ctx)
    assert summary["warnings"] == ["learned: samples 100 > the 8 calibration samples; using all"]


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["learned-w4", "learned-w3", "learned-w4-gpu"])
def test_the_shipped_recipes_are_valid_and_never_calibrate_on_the_eval_text(name):
    from lmpress.data import same_text
    from lmpress.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml", ["model.device=cpu"])
    stage, *rest = recipe.stages
    assert isinstance(stage, LearnedRoundingConfig) and stage.group_size == 64 and stage.symmetric
    assert (recipe.data.source, recipe.eval.text) == ("builtin:wikitext2:valid", "builtin:wikitext2:test")
    # the full-quality recipes then distill scales and norms on the calibration samples themselves
    assert [(s.method, s.train_on, s.learn_weights) for s in rest] == (
        [] if name == "learned-w4" else [("distill", "calibration", False)]
    )
    for s in recipe.stages:
        assert not any(same_text(text, recipe.eval.text) for text in s.training_texts(recipe.data.source))
    assert [str(g) for g in recipe.gates] == [
        {"learned-w4": "ppl <= 23.4", "learned-w3": "ppl <= 26.5", "learned-w4-gpu": "ppl <= 22.45"}[name]
    ]


# Through the CLI: exports and resume --------------------------------------------------------------


def _recipe(model_dir: Path, tmp_path: Path, stage: dict, formats: list[str]) -> Path:
    recipe = {
        "model": str(model_dir),
        "data": {"source": "builtin:python-docs", "samples": 4, "seq_len": 64},
        "stages": [{"method": "learned", "iterations": 3, "batch_size": 2, **stage}],
        "export": {"formats": formats},
        "eval": {"text": "builtin:python-docs", "perplexity": {"seq_len": 64, "windows": 2}},
        "gates": ["ppl_ratio <= 1000"],
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.long
@pytest.mark.parametrize(
    ("stage", "formats"),
    [
        ({"bits": 4, "group_size": 32}, ["gptq", "compressed-tensors", "awq", "gguf", "onnx", "hf"]),
        ({"bits": 3, "group_size": 64, "symmetric": False, "init": "gptq"}, ["gptq", "compressed-tensors", "hf"]),
        # negative scales (a group whose extreme is negative) in every packed format
        (
            {"bits": 4, "group_size": 32, "full_range": True},
            ["gptq", "compressed-tensors", "awq", "gguf", "onnx", "hf"],
        ),
    ],
    ids=["w4-g32-sym-every-format", "w3-g64-asym", "w4-g32-full-range-every-format"],
)
def test_learned_artifacts_export_to_every_format_the_scheme_allows_and_load_back(
    tiny_llama_dir, tmp_path, monkeypatch, stage, formats
):
    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    assert main(["run", str(_recipe(tiny_llama_dir, tmp_path, stage, formats)), "--out", str(out), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [c["format"] for c in report["export_checks"]] == formats
    assert all(c["passed"] for c in report["export_checks"]), report["export_checks"]


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("deep-llama"), "llama", num_hidden_layers=4)


def _sha256_dir(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.glob("*.safetensors"))}


RESUME_STAGE = {"bits": 4, "group_size": 32, "init": "awq"}
RESUME_FORMATS = ["compressed-tensors", "gptq"]


def _assert_resumed_identically(out: Path, ref: Path) -> None:
    report = json.loads((out / "report.json").read_text())
    assert report["stages"][0]["summary"]["resumed_at_layer"] == 2
    for fmt in RESUME_FORMATS:
        assert _sha256_dir(out / fmt) == _sha256_dir(ref / fmt), fmt


@pytest.mark.long
def test_resume_after_a_kill_gives_the_identical_artifact(deep_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LMPRESS_CACHE", str(tmp_path / "cache"))
    path = _recipe(deep_llama_dir, tmp_path, RESUME_STAGE, RESUME_FORMATS)
    _assert_resumed_identically(*run_killed_then_resumed(path, tmp_path))


def test_learned_values_stay_in_range(tiny_llama_dir, monkeypatch):
    loaded = load_model(str(tiny_llama_dir))
    config = LearnedRoundingConfig(bits=2, group_size=32, iterations=30, lr=0.2, batch_size=4, symmetric=False)
    session = layer0_session(loaded.model, calibration_for(loaded.tokenizer), config)
    from lmpress.quantize import learned_rounding

    seen: list[Rounding] = []
    original = learned_rounding.learned_fake_quantize

    def spy(w, scheme, rounding):
        seen.append(rounding)
        return original(w, scheme, rounding)

    monkeypatch.setattr(learned_rounding, "learned_fake_quantize", spy)
    LearnedRoundingMethod(config).prepare_layer(session)
    for r in seen:
        assert V_RANGE[0] <= r.v.min() and r.v.max() <= V_RANGE[1]
        for t in (r.alpha, r.beta):
            assert CLIP_RANGE[0] <= t.min() and t.max() <= CLIP_RANGE[1]
    assert any((r.alpha < 1).any() for r in seen) and any((r.v != 0).any() for r in seen)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "stage", [{"method": "gptq", "bits": 4, "group_size": 32}, {"method": "learned", "bits": 4, "group_size": 32}]
)
def test_calibration_on_cuda_matches_the_cpu(tiny_llama_dir, tmp_path, stage):
    """model.device: cuda — one layer and its activations on the GPU at a time, the rest of the model on the CPU."""
    from lmpress import quantize_model

    outputs = {}
    for device in ("cpu", "cuda"):
        loaded = load_model(str(tiny_llama_dir))
        settings = {k: v for k, v in stage.items() if k != "method"}
        if stage["method"] == "learned":
            settings.update(iterations=8, batch_size=4)
        data = {"source": "builtin:python-docs", "samples": 8, "seq_len": 32}
        state = tmp_path / device
        quantize_model(loaded.model, loaded.tokenizer, stage["method"], data, state, device=device, **settings)
        assert all(p.device.type == "cpu" for p in loaded.model.parameters())  # every layer went back
        ids = calibration_for(loaded.tokenizer, n=2)
        with torch.no_grad():
            outputs[device] = loaded.model(ids).logits
    torch.testing.assert_close(outputs["cuda"], outputs["cpu"], rtol=2e-2, atol=2e-2)


class ScaledBlock(torch.nn.Module):
    """Two linears and a per-sample (batch, 1, 1) or shared (1, 1, 1) scale passed as a keyword, as masks are."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 24), torch.nn.Linear(24, 16)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.down(torch.nn.functional.silu(self.up(x) * scale)),)


@pytest.mark.parametrize("per_sample", [True, False])
def test_the_error_and_gradient_summed_per_sample_are_the_whole_batchs(per_sample):
    """One sample at a time, a batch-shaped keyword sliced to its row, a shared one passed whole: the float64
    sums are the batched squared error and gradient of an independent float64 computation."""
    torch.manual_seed(0)
    block = ScaledBlock().requires_grad_(False)
    hidden, target = torch.randn(5, 7, 16), torch.randn(5, 7, 16)
    scale = torch.rand(5 if per_sample else 1, 1, 1) + 0.5
    weights = {"up.weight": block.up.weight.clone().requires_grad_(True), "down.weight": block.down.weight.clone()}
    error, grads = summed_over_samples(block, weights, hidden, {"scale": scale}, target)

    reference = ScaledBlock().double()
    reference.load_state_dict(block.state_dict())
    reference.requires_grad_(False).up.weight.requires_grad_(True)
    expected = torch.sum((reference(hidden.double(), scale.double())[0] - target.double()) ** 2)
    (expected_grad,) = torch.autograd.grad(expected, [reference.up.weight])
    assert error.dtype == torch.float64 and error.item() == pytest.approx(expected.item(), rel=1e-5)
    assert list(grads) == ["up.weight"] and grads["up.weight"].dtype == torch.float64
    assert torch.allclose(grads["up.weight"], expected_grad, rtol=1e-4, atol=1e-5)
