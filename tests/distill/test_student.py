"""Quantized layers train with fake quantization on their own grid and freeze back exactly; masks stay."""

import pytest
import torch
from torch import nn

from lmpress.distill.student import FakeQuantLinear, apply_masks, freeze_student, prepare_student
from lmpress.prune.masks import nm_mask, nm_pattern
from lmpress.weights.qlinear import QuantizedLinear, quantized_linear_from
from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn


def quantized(bits=3, group=32, symmetric=True, seed=0, in_features=64, out_features=48, weight=None):
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=True)
    if weight is not None:
        linear.weight.data.copy_(weight)
    scheme = QuantScheme(bits=bits, group_size=group, symmetric=symmetric)
    return quantized_linear_from(linear, quantize_weight_rtn(linear.weight.data, scheme))


@pytest.mark.parametrize("symmetric", [True, False])
def test_fake_quant_starts_at_the_quantized_layer_and_freezes_to_what_it_computes(symmetric):
    layer = quantized(symmetric=symmetric)
    x = torch.randn(5, 64)
    fake = FakeQuantLinear(layer)
    torch.testing.assert_close(fake(x), layer(x), rtol=0, atol=1e-6)
    # train a little: latent weights and scales move, rounding flips
    opt = torch.optim.Adam(fake.parameters(), lr=1e-2)
    for _ in range(20):
        opt.zero_grad()
        fake(x).pow(2).mean().backward()
        opt.step()
    frozen = fake.freeze()
    assert isinstance(frozen, QuantizedLinear) and frozen.scheme == layer.scheme
    assert not torch.equal(frozen.codes(), layer.codes())
    torch.testing.assert_close(frozen.dequantized_weight(), fake.quantized_weight().detach(), rtol=0, atol=0)
    torch.testing.assert_close(frozen(x), fake(x), rtol=0, atol=1e-5)


def test_scales_get_the_lsq_gradient():
    layer = quantized(bits=4, group=-1, in_features=8, out_features=1)
    fake = FakeQuantLinear(layer)
    w, s = fake.weight.detach(), fake.scales.detach()[:, 0]
    x = torch.ones(1, 8)
    fake(x).sum().backward()
    # d/ds of Σ (⌊w/s⌉) s with straight-through rounding: Σ (⌊w/s⌉ − w/s) inside the range
    expected = (torch.round(w / s) - w / s).sum()
    assert fake.scales.grad[0, 0].item() == pytest.approx(expected.item(), abs=1e-5)


def test_pruned_entries_stay_zero_and_2_4_stays_2_4_through_training(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    layer = model.model.layers[0]
    dense = layer.self_attn.q_proj
    dense.weight.data[nm_mask(dense.weight.abs(), 2, 4)] = 0
    w = layer.mlp.down_proj.weight.data.clone()
    w[nm_mask(w.abs(), 2, 4)] = 0
    layer.mlp.down_proj = quantized(bits=4, in_features=w.shape[1], out_features=w.shape[0], weight=w)
    counts = prepare_student(model)
    assert counts == {"fake_quantized_layers": 1, "masked_layers": 2}
    assert not model.get_input_embeddings().weight.requires_grad
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(0, 100, (2, 16))
    for _ in range(5):
        opt.zero_grad()
        model(ids).logits.logsumexp(-1).mean().backward()
        opt.step()
        apply_masks(model)
    assert nm_pattern(dense.weight.data) == "2:4"
    assert isinstance(layer.mlp.down_proj, FakeQuantLinear)
    freeze_student(model)
    assert isinstance(layer.mlp.down_proj, QuantizedLinear)
    assert nm_pattern(layer.mlp.down_proj.dequantized_weight()) == "2:4"
    assert not hasattr(dense, "prune_mask")
    assert not any(p.requires_grad for p in model.parameters())


def test_with_learn_weights_off_only_scales_and_norms_train_each_at_its_own_lr(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from lmpress.distill.config import DistillConfig
    from lmpress.distill.trainer import parameter_groups

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    layer = model.model.layers[0]
    w = layer.mlp.down_proj.weight.data.clone()
    layer.mlp.down_proj = quantized(bits=3, in_features=w.shape[1], out_features=w.shape[0], weight=w)
    prepare_student(model, learn_weights=False)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert "model.layers.0.mlp.down_proj.scales" in trainable
    assert "model.layers.0.input_layernorm.weight" in trainable and "model.norm.weight" in trainable
    assert not any(name.endswith(("proj.weight", "embed_tokens.weight")) for name in trainable)

    config = DistillConfig(lr=1e-5, scale_lr=2e-5, norm_lr=3e-4)
    groups = {g["lr"]: {id(p) for p in g["params"]} for g in parameter_groups(model, config)}
    params = dict(model.named_parameters())
    assert groups[1e-5] == {id(params["model.layers.0.mlp.down_proj.bias"])}  # biases still train, at lr
    assert groups[2e-5] == {id(params["model.layers.0.mlp.down_proj.scales"])}
    norms = {id(p) for name, p in params.items() if "norm" in name}
    assert groups[3e-4] == norms


def fp4_layer(fmt="nvfp4", activations=None, seed=0, in_features=64, out_features=48):
    from lmpress.weights.fp4 import FP4_BLOCK, Fp4Linear, nvfp4_global_scale, quantize_weight_fp4

    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=True)
    scheme = QuantScheme(4, FP4_BLOCK[fmt], True, activations=activations, fp4=fmt)
    fp4 = quantize_weight_fp4(linear.weight.data, scheme, mse=True)
    if activations:
        fp4.input_global_scale = nvfp4_global_scale(torch.randn(8, in_features)) if fmt == "nvfp4" else None
    return Fp4Linear.from_weight(fp4, linear.bias.data)


@pytest.mark.parametrize("fmt,activations", [("nvfp4", None), ("mxfp4", None), ("nvfp4", "fp4"), ("mxfp4", "fp4")])
def test_fp4_fake_quant_starts_at_the_layer_and_freezes_to_what_it_computes(fmt, activations):
    """An FP4 layer trains on its own grid: at the start it is the layer (frozen untrained: the same bytes); after
    training, its block scales in the format's encoding, and the frozen layer computes what the last forward did."""
    from lmpress.distill.student import FakeQuantFp4Linear
    from lmpress.weights.fp4 import Fp4Linear

    layer = fp4_layer(fmt, activations)
    x = torch.randn(5, 64)
    fake = FakeQuantFp4Linear(layer)
    torch.testing.assert_close(fake(x), layer(x), rtol=0, atol=1e-6)
    untrained = fake.freeze()
    for name, buffer in layer.named_buffers():
        assert torch.equal(getattr(untrained, name).view(torch.uint8), buffer.view(torch.uint8)), name
    x.requires_grad_(True)
    groups = [{"params": [fake.weight, fake.bias], "lr": 1e-2}, {"params": [fake.scales], "lr": 1e-3}]
    opt = torch.optim.Adam(groups)  # the block scales are ~0.01: a step of 1e-2 would take them through zero
    for _ in range(20):
        opt.zero_grad()
        fake(x).pow(2).mean().backward()
        opt.step()
    assert x.grad is not None and x.grad.abs().sum() > 0  # straight through the activations' quantization too
    frozen = fake.freeze()
    assert isinstance(frozen, Fp4Linear) and frozen.scheme == layer.scheme
    assert not torch.equal(frozen.weight_scale.view(torch.uint8), layer.weight_scale.view(torch.uint8))
    assert not torch.equal(frozen.weight_packed, layer.weight_packed)
    torch.testing.assert_close(frozen.dequantized_weight(), fake.quantized_weight().detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(frozen(x), fake(x), rtol=0, atol=1e-5)


def test_fp4_block_scales_get_the_lsq_gradient_through_their_encoding():
    """d/ds of Σ e2m1(w/s)·s with straight-through rounding (LSQ): e2m1(w/s) − w/s inside the range, ±6 outside,
    the scale's own rounding to E4M3 passed straight through."""
    from lmpress.distill.student import FakeQuantFp4Linear
    from lmpress.weights.fp4 import fake_quantize_e2m1

    fake = FakeQuantFp4Linear(fp4_layer(in_features=16, out_features=1))
    with torch.no_grad():
        fake.scales.mul_(0.5)  # some weights now beyond ±6 steps: clipped
    w, s = fake.weight.detach()[0], fake._effective_scales()[0, 0]
    fake(torch.ones(1, 16)).sum().backward()
    t = w / s
    inside = t.abs() <= 6
    assert 0 < int(inside.sum()) < 16
    expected = torch.where(inside, fake_quantize_e2m1(t.clamp(-6, 6)) - t, torch.sign(t) * 6).sum()
    assert fake.scales.grad[0, 0].item() == pytest.approx(expected.item(), abs=1e-4)


def assert_gradients_are_autograds(fake: nn.Module) -> None:
    """A fake-quantized layer (64 inputs, 12 outputs), every other group's scale shrunk so that some latent weights
    clip: its forward equals ``F.linear(x, quantized_weight())`` bit for bit and its gradients for the input, the
    scales and any latent weight are autograd's over that expression."""
    fake.bias = None
    with torch.no_grad():
        fake.scales[:, ::2].mul_(0.6)
    x = torch.randn(3, 5, 64, requires_grad=True)
    grad = torch.randn(3, 5, 12)
    wanted = [x, fake.scales] + ([fake.weight] if fake.weight is not None else [])
    ours = fake(x)
    reference = torch.nn.functional.linear(x, fake.quantized_weight())
    assert torch.equal(ours, reference)
    for a, b in zip(torch.autograd.grad(ours, wanted, grad), torch.autograd.grad(reference, wanted, grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))  # sums that cancel


@pytest.mark.parametrize("learn_weights", [True, False])
def test_fp4_fake_quant_forward_and_gradients_are_autograds_over_the_same_expression(learn_weights):
    """Fp4BlocksLinear's hand-written backward gives what autograd gives over ``F.linear(x, quantized_weight())``
    (a latent weight's e2m1 rounding written with straight_through; or the fixed codes times the scales) for the
    input, the latent weights and the block scales, with scales where some weights clip; its forward is that
    expression's, bit for bit."""
    from lmpress.distill.student import FakeQuantFp4Linear

    fake = FakeQuantFp4Linear(fp4_layer(in_features=64, out_features=12), learn_weights=learn_weights)
    assert_gradients_are_autograds(fake)


@pytest.mark.parametrize("learn_weights", [True, False])
@pytest.mark.parametrize("symmetric, act_order", [(True, False), (False, False), (False, True)])
def test_int_fake_quant_forward_and_gradients_are_autograds_over_the_same_expression(
    learn_weights, symmetric, act_order
):
    """IntGroupsLinear's hand-written backward gives what autograd gives over ``F.linear(x, quantized_weight())``
    (LSQ's straight-through rounding of a latent weight, or the fixed codes times the scales) for the input, the
    latent weights and the group scales, with scales where some weights clip and with act-order's column groups;
    its forward is that expression's, bit for bit."""
    layer = quantized(bits=3, group=16, symmetric=symmetric, in_features=64, out_features=12)
    if act_order:
        layer.g_idx = torch.randperm(64, generator=torch.Generator().manual_seed(3)).int() // 16
    fake = FakeQuantLinear(layer, learn_weights=learn_weights)
    assert_gradients_are_autograds(fake)
    if learn_weights:
        scale, zero = fake._scale_zero()
        rounded = torch.round(fake.weight / scale) + zero
        assert bool(((rounded < 0) | (rounded > fake.scheme.maxq)).any())  # some weights clipped


@pytest.mark.parametrize("learn_weights", [True, False])
def test_int_fake_quant_keeps_no_float_copy_of_the_weight_for_the_backward_pass(learn_weights):
    """What the forward leaves for the backward pass: the input, the codes in a byte, the scales (and the latent
    weight itself), never a float32 tensor of the weight's size made by the forward."""
    fake = FakeQuantLinear(quantized(bits=4, group=16, in_features=64, out_features=48), learn_weights=learn_weights)
    x = torch.randn(2, 64)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fake(x).sum().backward()
    made = [t for t in saved if t.is_floating_point() and t.numel() >= 48 * 64 and t is not fake.weight]
    assert not made, [tuple(t.shape) for t in made]
    assert any(t.dtype == torch.uint8 and t.numel() == 48 * 64 for t in saved)


@pytest.mark.parametrize("kind", ["nvfp4", "int4"])
def test_with_codes_fixed_the_scales_get_a_gradient_at_the_start_and_the_codes_never_move(kind):
    """learn_weights off: the scales' gradient is Σ code · ∂L/∂w from the first step (LSQ's over a weight on the
    grid is 0 there), training them lowers the loss, and the frozen layer keeps the original codes."""
    from lmpress.distill.student import FakeQuantFp4Linear, FakeQuantLinear
    from lmpress.weights.qlinear import quantized_linear_from
    from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

    if kind == "nvfp4":
        layer = fp4_layer(in_features=64, out_features=12)
        fake = FakeQuantFp4Linear(layer, learn_weights=False)
        codes = layer.weight_packed
    else:
        torch.manual_seed(0)
        linear = nn.Linear(64, 12)
        layer = quantized_linear_from(linear, quantize_weight_rtn(linear.weight.data, QuantScheme(4, 32, False)))
        fake = FakeQuantLinear(layer, learn_weights=False)
        codes = layer.qweight
    assert fake.weight is None and [n for n, p in fake.named_parameters()] == ["scales", "bias"]
    torch.manual_seed(1)
    x, target = torch.randn(32, 64), torch.randn(32, 12)

    def loss() -> torch.Tensor:
        return (fake(x) - target).pow(2).mean()

    start = loss()
    start.backward()
    assert fake.scales.grad.abs().min() > 0
    opt = torch.optim.Adam([fake.scales], lr=1e-3)
    for _ in range(30):
        opt.zero_grad()
        loss().backward()
        opt.step()
    assert loss() < 0.9 * start
    frozen = fake.freeze()
    frozen_codes = frozen.weight_packed if kind == "nvfp4" else frozen.qweight
    assert torch.equal(frozen_codes, codes)
    torch.testing.assert_close(frozen(x), fake(x), rtol=0, atol=1e-5)


def test_an_fp4_model_trains_its_block_scales_and_norms_with_learn_weights_off(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from lmpress.distill.student import FakeQuantFp4Linear
    from lmpress.weights.fp4 import Fp4Linear

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    layer = model.model.layers[0]
    down = layer.mlp.down_proj
    layer.mlp.down_proj = fp4_layer(in_features=down.in_features, out_features=down.out_features)
    counts = prepare_student(model, learn_weights=False)
    assert counts["fake_quantized_layers"] == 1 and isinstance(layer.mlp.down_proj, FakeQuantFp4Linear)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert "model.layers.0.mlp.down_proj.scales" in trainable and "model.norm.weight" in trainable
    assert "model.layers.0.mlp.down_proj.weight" not in trainable
    assert freeze_student(model) == 1 and isinstance(layer.mlp.down_proj, Fp4Linear)
