"""SpinQuant's learned rotations: orthogonal by construction, trained on what the quantized network computes (its
hooks checked against the rotated model with its activations quantized), lowering that network's loss, and fused
as the same function."""

import pytest
import torch
from pydantic import ValidationError

from lmpress.errors import LmpressInputError
from lmpress.quantize.learned_rotations import (
    LearnRotationsConfig,
    cayley,
    learn_rotations,
    quantize_activations_ste,
    rotated_quantization_hooks,
)
from lmpress.quantize.rotate import RotateConfig, fold_norms, residual_parts, run_rotate
from lmpress.registry import StageContext
from lmpress.weights.fp4 import fake_quantize_fp4_activations
from lmpress.weights.hadamard import random_hadamard
from lmpress.weights.int8_linear import fake_quantize_per_token
from tests.quantize.test_rotate import VOCAB, exact_norms, logits, tiny_model

DOWN_BLOCK = 64  # the tiny model's MLP width 192 = 3 x 64


def samples(n: int = 4, seq_len: int = 32) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, seq_len), generator=torch.Generator().manual_seed(7))


def test_cayley_is_orthogonal_and_starts_at_the_identity():
    b = torch.randn(40, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    c = cayley(b)
    assert torch.allclose(c.T @ c, torch.eye(40, dtype=torch.float64), atol=1e-12)
    assert torch.equal(cayley(torch.zeros(8, 8)), torch.eye(8))


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4", "int8"])
def test_the_straight_through_quantizer_gives_the_quantizers_values_and_a_gradient(kind):
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 5, 64)
    expected = fake_quantize_per_token(x) if kind == "int8" else fake_quantize_fp4_activations(x, kind)
    x.requires_grad_(True)
    q = quantize_activations_ste(x, kind)
    assert torch.allclose(q, expected, rtol=1e-6, atol=0)
    (q * torch.arange(64.0)).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def _quantize_inputs(model, kind):
    """Every decoder linear's input quantized per call (after the online R4 rotation, as the runtime does)."""
    linears = [m for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)]
    return [
        m.register_forward_pre_hook(lambda module, args: (fake_quantize_fp4_activations(args[0], kind), *args[1:]))
        for m in linears
    ]


def test_the_hooks_compute_the_rotated_model_with_quantized_activations(monkeypatch, tmp_path):
    """The learning's forward (rotations applied to the activations of the unrotated, folded model) against the
    independent route: the rotation fused into the weights, every linear's input quantized."""
    kind = "nvfp4"
    model = tiny_model("LlamaConfig", torch.float64, tie_word_embeddings=False)
    exact_norms(model, monkeypatch)
    reference = tiny_model("LlamaConfig", torch.float64, tie_word_embeddings=False)
    run_rotate(reference, RotateConfig(seed=5, rotate_down_proj=True), context(tmp_path))
    handles = _quantize_inputs(reference, kind)
    expected = logits(reference)
    for handle in handles:
        handle.remove()

    parts = residual_parts(model)
    fold_norms(model, parts, torch.device("cpu"))
    q, h = random_hadamard(96, 5), random_hadamard(24, 5)
    handles = rotated_quantization_hooks(model, parts, lambda: (q, [h, h]), DOWN_BLOCK, kind)
    simulated = logits(model)
    for handle in handles:
        handle.remove()
    unquantized = logits(model)
    error = (simulated - expected).abs().max() / expected.abs().max()
    assert error < 1e-6, error
    # and the quantization is not a no-op here (the comparison above would pass for any two float models)
    assert (unquantized - expected).abs().max() / expected.abs().max() > 1e-3


def context(tmp_path, data=None) -> StageContext:
    return StageContext(calibration=lambda: data, state_dir=tmp_path, resume=False, fingerprint="x")


def test_learning_lowers_the_quantized_networks_loss():
    kind = "nvfp4"
    model = tiny_model("LlamaConfig", tie_word_embeddings=False)
    with torch.no_grad():  # peaked next-token distributions, as a trained model's: quantization moves them
        model.lm_head.weight.mul_(10)
    parts = residual_parts(model)
    fold_norms(model, parts, torch.device("cpu"))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = LearnRotationsConfig(activations=kind, steps=60, lr=1e-4, batch_size=4)
    learned = learn_rotations(
        model, parts, samples(), random_hadamard(96, 0), random_hadamard(24, 0), DOWN_BLOCK, config, _quiet()
    )
    # the same 4 samples each step, so the losses compare; 0.87x measured (a wrong sign climbs instead)
    first, last = sum(learned.losses[:10]) / 10, sum(learned.losses[-10:]) / 10
    assert last < 0.95 * first, learned.losses
    eye = torch.eye(96, dtype=torch.float64)
    assert torch.allclose(learned.residual.T @ learned.residual, eye, atol=1e-12)
    assert len(learned.heads) == 2 and not torch.allclose(learned.residual, random_hadamard(96, 0))
    assert all(torch.equal(p, weights[n]) and p.requires_grad for n, p in model.named_parameters())


def _quiet():
    from lmpress.progress import QUIET

    return QUIET


def test_the_stage_fuses_learned_rotations_as_the_same_function(tmp_path):
    model = tiny_model("LlamaConfig", tie_word_embeddings=True)
    before = logits(model)
    hadamard = tiny_model("LlamaConfig", tie_word_embeddings=True)
    run_rotate(hadamard, RotateConfig(seed=2), context(tmp_path))
    learn = {"activations": "mxfp4", "steps": 3, "lr": 1e-2}
    info = run_rotate(model, RotateConfig(seed=2, learn=learn), context(tmp_path, samples()))
    after = logits(model)
    assert ((after - before).abs().max() / before.abs().max()).item() < 1e-5
    assert info["learned_steps"] == 3 and set(info["learned_loss"]) == {"first", "last"}
    assert info["untied_head"] and model.config.tie_word_embeddings is False
    # the learned R1 is not the Hadamard start the plain stage fuses
    assert not torch.allclose(model.model.embed_tokens.weight, hadamard.model.embed_tokens.weight, atol=1e-4)


def test_learning_is_refused_without_the_residual_rotation_and_checks_its_keys():
    model = tiny_model("LlamaConfig")
    with pytest.raises(LmpressInputError, match="learn trains R1"):
        RotateConfig(residual=False, learn={"activations": "nvfp4"}).check(model)
    with pytest.raises(LmpressInputError, match="learn trains R1"):
        RotateConfig(input_block=16, learn={"activations": "nvfp4"}).check(model)
    with pytest.raises(ValidationError, match="step"):
        RotateConfig(learn={"activations": "nvfp4", "step": 3})
    with pytest.raises(ValidationError, match="activations"):
        RotateConfig(learn={"activations": "int4"})


def test_a_model_that_gives_nans_stops_learning_with_a_clear_error(tmp_path):
    model = tiny_model("LlamaConfig", tie_word_embeddings=False)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    config = RotateConfig(learn={"activations": "nvfp4", "steps": 2})
    with pytest.raises(LmpressInputError, match=r"learn: the quantized network's loss is nan at step 0"):
        run_rotate(model, config, context(tmp_path, samples()))
