"""The runtime decoder against transformers on the same weights; its quantized path against dequantize-then-matmul."""

from __future__ import annotations

import pytest
import torch

import lmpress
from lmpress.errors import LmpressInputError
from lmpress.runtime.kernels import cpu_int
from lmpress.runtime.kernels.cpu import DenseLinear, Int4Linear, Int8Linear, cpu_linear, kernel_name
from lmpress.runtime.kernels.cpu_int import W4A8Linear, W8A8RowLinear
from lmpress.runtime.model import Transformer
from lmpress.weights.qlinear import QuantizedLinear
from tests.runtime.conftest import FAMILIES, tiny_hf_model


def sqnr_db(reference: torch.Tensor, actual: torch.Tensor) -> float:
    noise = (reference.float() - actual.float()).pow(2).mean()
    return float(10 * torch.log10(reference.float().pow(2).mean() / noise))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    hf = tiny_hf_model(family)
    model = Transformer.from_hf(hf)
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        actual = model(ids, model.new_cache(2, 32))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_equals_full_sequence(family):
    hf = tiny_hf_model(family, seed=3)
    model = Transformer.from_hf(hf)
    ids = torch.randint(0, hf.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids, model.new_cache(1, 16))
        cache = model.new_cache(1, 16)
        steps = [model(ids[:, :10], cache)] + [model(ids[:, i : i + 1], cache) for i in range(10, 16)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_llama3_rope_scaling_and_untied_head():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope |= {"original_max_position_embeddings": 64, "rope_theta": 500000.0}
    hf = tiny_hf_model("llama", rope_parameters=rope, tie_word_embeddings=False)
    model = Transformer.from_hf(hf)
    ids = torch.randint(0, hf.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, model.new_cache(1, 200)), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_mistral_sliding_window_matches_transformers():
    hf = tiny_hf_model("mistral", sliding_window=8)
    model = Transformer.from_hf(hf)
    ids = torch.randint(0, hf.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        cache = model.new_cache(1, 30)
        steps = [model(ids[:, :20], cache)] + [model(ids[:, i : i + 1], cache) for i in range(20, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-5, rtol=1e-5)


def test_fused_projections():
    model = Transformer.from_hf(tiny_hf_model("qwen2"))
    attention = model.layers[0].attention
    assert len(attention.wqkv.parts) == 1 and attention.wqkv.sizes == [4 * 32, 2 * 32, 2 * 32]
    assert attention.wqkv.parts[0].bias is not None
    assert len(model.layers[0].feed_forward.w13.parts) == 1


def test_bf16_model_runs_in_bf16():
    hf = tiny_hf_model("llama")
    model = Transformer.from_hf(hf, dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        out = model(ids, model.new_cache(1, 8))
        expected = hf(ids).logits
    assert out.dtype == torch.bfloat16
    assert sqnr_db(expected, out) > 25


@pytest.mark.parametrize(
    ("bits", "group_size", "kernel", "activations"),
    [
        (4, 32, Int4Linear, "int8"),  # groups of 32: torch's packed kernel
        (4, 64, W4A8Linear, "int8"),
        (4, 64, Int4Linear, "bf16"),  # bf16 activations asked for: torch's packed kernels
        (8, -1, W8A8RowLinear, "int8"),
        (8, -1, Int8Linear, "bf16"),
    ],
)
def test_quantized_model_matches_dequantized_reference(bits, group_size, kernel, activations):
    if kernel in (W4A8Linear, W8A8RowLinear) and not cpu_int.available():
        pytest.skip("lmpress's C++ kernels do not build here")
    hf = tiny_hf_model("llama", seed=5)
    lmpress.quantize_model(hf, method="rtn", bits=bits, group_size=group_size, symmetric=bits == 4)
    model = Transformer.from_hf(hf, cpu_activations=activations)
    assert isinstance(model.layers[0].attention.wqkv.parts[0], kernel)
    assert isinstance(model.output, DenseLinear)  # the float head is float whatever the setting
    assert len(model.layers[0].attention.wqkv.parts) == 1  # q/k/v quantized alike: fused
    reference = _dequantized_copy(hf)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids, reference.new_cache(2, 12))
        actual = model(ids, model.new_cache(2, 12))
    # bf16 activations into the packed kernels: ~2-3 significant digits per matmul.
    assert sqnr_db(expected, actual) > 30


@pytest.mark.parametrize("bits", [4, 8])
def test_the_layers_kernel_buffers_share_one_huge_page_block_in_step_order(monkeypatch, bits):
    """A CPU build moves its layers' codes, scales and zeros into one 2 MiB-aligned block (huge pages), 64-byte
    aligned, in the order a decode step reads them; the logits are those of the build that leaves them apart."""
    import lmpress.runtime.model as runtime_model

    if not cpu_int.available():
        pytest.skip("lmpress's C++ kernels do not build here")
    hf = tiny_hf_model("llama", seed=5)
    lmpress.quantize_model(hf, method="rtn", bits=bits, group_size=64 if bits == 4 else -1, symmetric=bits == 4)
    gathered = Transformer.from_hf(hf)
    monkeypatch.setattr(runtime_model, "gather_into_huge_pages", lambda modules: 0)
    apart = Transformer.from_hf(hf)
    kernels = [m for m in gathered.layers.modules() if isinstance(m, (W4A8Linear, W8A8RowLinear))]
    assert len(kernels) == 4 * len(gathered.layers)  # q/k/v, o, gate/up, down
    buffers = [t for m in kernels for t in (m.codes, m.scales, m.zeros)]
    block = buffers[0].untyped_storage()
    assert block.data_ptr() % (2 << 20) == 0
    assert all(t.untyped_storage().data_ptr() == block.data_ptr() for t in buffers)
    starts = [t.data_ptr() for t in buffers]
    assert starts == sorted(starts) and all(start % 64 == 0 for start in starts)
    apart_buffers = [
        t for m in apart.layers.modules() if isinstance(m, W4A8Linear | W8A8RowLinear) for t in m.buffers()
    ]
    assert len({t.untyped_storage().data_ptr() for t in apart_buffers}) > 1
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(gathered(ids, gathered.new_cache(2, 12)), apart(ids, apart.new_cache(2, 12)))


def _dequantized_copy(hf) -> Transformer:
    import copy

    dense = copy.deepcopy(hf)
    for name, module in list(dense.named_modules()):
        if isinstance(module, QuantizedLinear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(module.dequantized_weight())
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            parent, _, child = name.rpartition(".")
            setattr(dense.get_submodule(parent), child, linear)
    return Transformer.from_hf(dense)


@pytest.mark.parametrize(("bits", "group_size", "symmetric"), [(4, 64, True), (4, 128, False), (8, -1, False)])
def test_cpu_kernel_matches_dequantize_then_matmul(bits, group_size, symmetric):
    from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    qw = quantize_weight_rtn(weight, QuantScheme(bits, group_size, symmetric))
    layer = QuantizedLinear.from_quantized_weight(qw, bias=torch.randn(96))
    fast = cpu_linear(layer, torch.float32)
    assert kernel_name(fast) == f"int{bits}"
    for rows in (1, 7, 300):  # decode, small batch, prefill beyond QuantizedLinear's 128-row limit
        x = torch.randn(rows, 256)
        expected = torch.nn.functional.linear(x, layer.dequantized_weight(), layer.bias)
        assert sqnr_db(expected, fast(x)) > 35


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("weight_left", [False, True])
def test_dense_linear_equals_f_linear(biased, weight_left):
    layer = DenseLinear(256, 96, bias=biased)
    layer.left_for_one = layer.left_for_few = weight_left  # else timed: either way must give F.linear's numbers
    for shape in [(1, 256), (2, 256), (1, 3, 256), (1, 1, 256), (2, 9, 256), (300, 256)]:  # decode, verify, prefill
        x = torch.randn(*shape)
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        actual = layer(x)
        assert actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    half = DenseLinear(256, 96, bias=biased, dtype=torch.bfloat16)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(half(x), torch.nn.functional.linear(x, half.weight, half.bias))


def test_float_layers_and_tied_head_run_in_dense_linear():
    model = Transformer.from_hf(tiny_hf_model("llama"))
    assert isinstance(model.layers[0].attention.wqkv.parts[0], DenseLinear)
    assert isinstance(model.output, DenseLinear) and model.output.weight is model.tok_embeddings.weight
    shared = Transformer.from_hf(tiny_hf_model("llama"), kernels="reference")
    assert not any(isinstance(m, DenseLinear) for m in shared.modules())


def test_unfusable_quantized_layers_stay_separate():
    from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

    hf = tiny_hf_model("llama")
    attn = hf.model.layers[0].self_attn
    for name, scheme in (
        ("q_proj", QuantScheme(4, 32)),
        ("k_proj", QuantScheme(8, -1)),
        ("v_proj", QuantScheme(3, 32)),
    ):
        linear = getattr(attn, name)
        setattr(attn, name, QuantizedLinear.from_quantized_weight(quantize_weight_rtn(linear.weight.data, scheme)))
    model = Transformer.from_hf(hf)
    assert [kernel_name(p) for p in model.layers[0].attention.wqkv.parts] == ["int4", "int8", "dense"]
    reference = _dequantized_copy(hf)
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        assert sqnr_db(reference(ids, reference.new_cache(1, 10)), model(ids, model.new_cache(1, 10))) > 30


def test_unsupported_architecture_is_input_error(tiny_opt_dir):
    from transformers import AutoModelForCausalLM

    with pytest.raises(LmpressInputError, match="does not support model type 'opt'"):
        Transformer.from_hf(AutoModelForCausalLM.from_pretrained(tiny_opt_dir))


def test_cache_is_preallocated_and_rolls_back():
    model = Transformer.from_hf(tiny_hf_model("llama"))
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(1, 12)
    storage = [t.data_ptr() for t in cache.k + cache.v]
    with torch.no_grad():
        model(ids[:, :6], cache)
        first = model(ids[:, 6:9], cache)
        cache.truncate(6)  # drop the last three tokens, as a rejected speculative round does
        model(torch.randint(0, 256, (1, 3)), cache)
        cache.truncate(6)
        again = model(ids[:, 6:9], cache)
    assert [t.data_ptr() for t in cache.k + cache.v] == storage and cache.length == 9
    torch.testing.assert_close(again, first)
    with pytest.raises(LmpressInputError, match="exceed the cache"):
        model(ids[:, :4], cache)
    with pytest.raises(LmpressInputError, match="context of 256"):
        model.new_cache(1, 257)


def test_unknown_cpu_activations_are_an_input_error():
    hf = tiny_hf_model("llama", seed=5)
    lmpress.quantize_model(hf, method="rtn", bits=4, group_size=64)
    with pytest.raises(LmpressInputError, match="activations 'fp4': choose int8 or bf16"):
        Transformer.from_hf(hf, cpu_activations="fp4")


@pytest.mark.usefixtures("private_cache")
def test_the_matmul_probe_is_timed_once_per_host_and_read_from_the_cache_after(monkeypatch):
    """A new process (in-memory answers forgotten) reads the probe's answer from lmpress's tuning cache instead of
    timing again; another CPU (flags differ) times afresh."""
    from lmpress.runtime.kernels import cpu as cpu_kernels
    from lmpress.runtime.kernels.tuning import forget_in_memory

    timed = []
    real = cpu_kernels.time.perf_counter
    monkeypatch.setattr(cpu_kernels.time, "perf_counter", lambda: timed.append(1) or real())
    monkeypatch.setattr(cpu_kernels, "STREAMED_BYTES", 2**20)
    side = int((cpu_kernels.PROBED_MIN_BYTES // 4) ** 0.5) + 1

    def new_process() -> tuple[bool, bool]:
        forget_in_memory()
        cpu_kernels.weight_left_is_faster.cache_clear()
        timed.clear()
        return cpu_kernels.weight_left_is_faster(side, side, 1)

    first = new_process()
    assert timed
    assert new_process() == first and not timed
    monkeypatch.setattr(cpu_kernels, "cpu_model", lambda: "another CPU (flags 00000000)")
    new_process()
    assert timed
    cpu_kernels.weight_left_is_faster.cache_clear()


@pytest.mark.usefixtures("private_cache")  # a shape timed before in this cache is read from it, untimed
def test_small_weights_run_f_linear_untimed(monkeypatch):
    """A MoE router's 1 x 128 gate took 58 s of timing (262,144 copies streamed per pass); below
    ``PROBED_MIN_BYTES`` no product is timed, and from it on the shape is timed as before."""
    from lmpress.runtime.kernels import cpu as cpu_kernels

    timed = []
    real = cpu_kernels.time.perf_counter
    monkeypatch.setattr(cpu_kernels.time, "perf_counter", lambda: timed.append(1) or real())
    monkeypatch.setattr(cpu_kernels, "STREAMED_BYTES", 2**20)
    cpu_kernels.weight_left_is_faster.cache_clear()
    assert cpu_kernels.weight_left_is_faster(1, 128, 1) == (False, False) and timed == []
    side = int((cpu_kernels.PROBED_MIN_BYTES // 4) ** 0.5) + 1
    cpu_kernels.weight_left_is_faster(side, side, 1)
    assert timed
    cpu_kernels.weight_left_is_faster.cache_clear()
