import pytest
import torch
from torch import nn

from lmpress.weights.apply import apply_quantized_weight
from lmpress.weights.qlinear import QuantizedLinear, quantized_linear_from
from lmpress.weights.scheme import QuantizedWeight, QuantScheme, quantize_weight_rtn


def act_order_weight(w: torch.Tensor, scheme: QuantScheme, seed: int = 0) -> QuantizedWeight:
    """A quantized weight whose groups are scattered over the input columns, as GPTQ act-order leaves them."""
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(seed))
    grouped = quantize_weight_rtn(w[:, perm], scheme)
    codes = torch.empty_like(grouped.qweight)
    codes[:, perm] = grouped.qweight
    g_idx = torch.empty(w.shape[1], dtype=torch.int32)
    g_idx[perm] = (torch.arange(w.shape[1]) // scheme.group_width(w.shape[1])).to(torch.int32)
    return QuantizedWeight(codes, grouped.scales, grouped.zeros, scheme, g_idx)


def linear(out_features=64, in_features=256, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    return float(10 * torch.log10(reference.pow(2).sum() / (reference - other).pow(2).sum().clamp_min(1e-30)))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_unpack_returns_what_was_packed(bits, symmetric):
    qw = quantize_weight_rtn(linear().weight.data, QuantScheme(bits, 64, symmetric))
    module = QuantizedLinear.from_quantized_weight(qw)
    back = module.unpack()
    assert torch.equal(back.qweight, qw.qweight)
    assert torch.equal(back.scales, qw.scales)
    assert torch.equal(back.zeros, qw.zeros)
    assert back.scheme == qw.scheme and back.g_idx is None
    assert module.qweight.dtype == torch.int32 and module.qweight.shape == (64, 256 * bits // 32)
    assert torch.equal(module.dequantized_weight(), qw.dequantize())


def test_act_order_layer_keeps_g_idx_and_dequantizes_bit_for_bit():
    qw = act_order_weight(linear().weight.data, QuantScheme(4, 32, False))
    module = QuantizedLinear.from_quantized_weight(qw)
    assert torch.equal(module.g_idx, qw.g_idx)
    assert torch.equal(module.dequantized_weight(), qw.dequantize())


KERNEL_CASES = [
    # bits, group size, symmetric, act-order, kernel
    (4, 32, True, False, "int4"),
    (4, 64, False, False, "int4"),
    (4, 128, True, False, "int4"),
    (4, -1, False, False, "int4"),  # per channel: scales repeated over groups of 32
    (4, 64, True, True, "int4"),  # act-order: input columns sorted by group
    (8, -1, True, False, "int8"),
    (8, -1, False, False, "int8"),  # zero != 128: row-sum correction
]


@pytest.mark.parametrize("bits,group_size,symmetric,act_order,kernel", KERNEL_CASES)
@pytest.mark.parametrize("dtype,mode", [(torch.bfloat16, "auto"), (torch.float32, "bf16")])
def test_cpu_kernels_match_the_dequantized_reference(bits, group_size, symmetric, act_order, kernel, dtype, mode):
    lin = linear(out_features=64, in_features=256)
    scheme = QuantScheme(bits, group_size, symmetric)
    qw = act_order_weight(lin.weight.data, scheme) if act_order else quantize_weight_rtn(lin.weight.data, scheme)
    module = quantized_linear_from(lin, qw)
    module.kernel = mode
    assert module.kernel_name() == kernel
    x = torch.randn(2, 3, 256)
    with torch.no_grad():
        fast = module(x.to(dtype))
        module.kernel = "reference"
        reference = module(x)
    assert fast.dtype == dtype and fast.shape == (2, 3, 64)
    # Both kernels compute in bfloat16 (8-bit mantissa): about 50 dB against the float32 reference.
    assert sqnr_db(reference, fast.float()) > 40


def test_float32_inputs_take_the_reference_path_unless_asked():
    lin = linear()
    qw = quantize_weight_rtn(lin.weight.data, QuantScheme(4, 64, True))
    module = quantized_linear_from(lin, qw)
    x = torch.randn(1, 256)
    with torch.no_grad():
        exact = nn.functional.linear(x, qw.dequantize(), lin.bias)
        assert torch.equal(module(x), exact)
        module.kernel = "bf16"
        assert not torch.equal(module(x), exact)


@pytest.mark.parametrize(
    "bits,group_size,out_features,rows",
    [(3, 32, 64, 1), (2, 64, 64, 1), (8, 64, 64, 1), (4, 64, 24, 1), (4, 64, 64, 129)],
)
def test_layouts_the_kernels_cannot_take_use_the_reference_exactly(bits, group_size, out_features, rows):
    lin = linear(out_features=out_features)
    qw = quantize_weight_rtn(lin.weight.data, QuantScheme(bits, group_size, True))
    module = quantized_linear_from(lin, qw)
    x = torch.randn(rows, 256).bfloat16()
    with torch.no_grad():
        expected = nn.functional.linear(x, qw.dequantize(torch.bfloat16), lin.bias.bfloat16())
        assert torch.equal(module(x), expected)


def test_inputs_that_need_gradients_take_the_reference_path():
    lin = linear()
    module = quantized_linear_from(lin, quantize_weight_rtn(lin.weight.data, QuantScheme(4, 64, True)))
    x = torch.randn(1, 256, requires_grad=True)
    module(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_apply_swaps_the_linear_and_keeps_bias_and_forward():
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 32, bias=False))
    x = torch.randn(5, 256)
    qw = quantize_weight_rtn(model[0].weight.data, QuantScheme(4, 32, False))
    bias = model[0].bias.detach().clone()
    fake = nn.functional.linear(x, qw.dequantize(), bias)
    module = apply_quantized_weight(model, "0", qw)
    assert model[0] is module and isinstance(module, QuantizedLinear)
    assert torch.equal(module.bias, bias)
    with torch.no_grad():
        assert torch.equal(model[0](x), fake)
    again = quantize_weight_rtn(model[2].weight.data, QuantScheme(8, -1, True))
    apply_quantized_weight(model, "2", again)
    requantized = quantize_weight_rtn(qw.dequantize(), QuantScheme(8, 64, True))
    apply_quantized_weight(model, "0", requantized)  # an already quantized layer takes a new weight
    assert model[0].scheme == QuantScheme(8, 64, True)
    assert torch.equal(model[0].bias, bias)
    with pytest.raises(TypeError, match="not an nn.Linear"):
        apply_quantized_weight(model, "1", qw)
    with pytest.raises(ValueError, match="does not match"):
        apply_quantized_weight(nn.Sequential(nn.Linear(128, 64)), "0", qw)


def test_dtype_casts_keep_the_scales_exact():
    lin = linear()
    qw = quantize_weight_rtn(lin.weight.data, QuantScheme(4, 64, False))
    module = quantized_linear_from(lin, qw).to(torch.bfloat16)
    assert module.scales.dtype == torch.float32 and torch.equal(module.scales, qw.scales)
    assert module.bias.dtype == torch.bfloat16
    assert torch.equal(module.dequantized_weight(), qw.dequantize())


def test_a_bfloat16_model_decodes_through_the_kernels_like_the_reference(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head":
            apply_quantized_weight(model, name, quantize_weight_rtn(module.weight.data, QuantScheme(4, 32, True)))
    model.to(torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 14 and all(m.kernel_name() == "int4" for m in layers)
    ids = torch.tensor([[1, 7, 42, 99, 3, 250]])
    with torch.no_grad():
        fast = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
        for m in layers:
            m.kernel = "reference"
        reference = [model(fast.sequences[:, : ids.shape[1] + i]).logits[:, -1] for i in range(6)]
    for step, logits in enumerate(fast.logits):
        assert sqnr_db(reference[step].float(), logits.float()) > 25, step


def test_w4a8_runs_per_token_int8_activations_times_the_dequantized_weight():
    """W4A8 (int4 groups, int8 activations per token): against a float64 computation written out here."""
    torch.manual_seed(0)
    w, x = torch.randn(48, 128), torch.randn(5, 128) * torch.logspace(-1, 1, 128)
    layer = QuantizedLinear.from_quantized_weight(quantize_weight_rtn(w, QuantScheme(4, 64, True, "int8")))
    step = x.double().abs().amax(-1, keepdim=True) / 127
    expected = (torch.round(x.double() / step) * step) @ layer.dequantized_weight(torch.float64).T
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
    weight_only = QuantizedLinear.from_quantized_weight(quantize_weight_rtn(w, QuantScheme(4, 64, True)))
    assert not torch.allclose(layer(x), weight_only(x), rtol=1e-4, atol=1e-4)  # the activations are rounded
    assert not layer.int8_matmul_holds
