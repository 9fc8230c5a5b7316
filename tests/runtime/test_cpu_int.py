"""lmpress's C++ int8-activation CPU kernels (kernels/cpu_int.py) against float64 references, on every instruction
set level this host runs (AVX-512 VNNI, AVX2, portable C++): tiny shapes, seconds once the library is built."""

from __future__ import annotations

import warnings

import pytest
import torch

from lmpress.runtime.kernels import cpu_int

pytestmark = pytest.mark.skipif(not cpu_int.available(), reason="the C++ kernels do not build on this host")


def levels() -> list[int]:
    return list(range(cpu_int.host_isa() + 1)) if cpu_int.available() else []


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and a scale per cpu_int.ACTIVATION_BLOCK values: d = max|x| / 127, q = round-half-even(x * (1 / d)),
    in float32 as the kernel."""
    blocks = x.float().reshape(x.shape[0], -1, cpu_int.ACTIVATION_BLOCK)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None])
    return q.reshape(x.shape).to(torch.int8), d


def dequantized_x(x: torch.Tensor) -> torch.Tensor:
    q, d = reference_quantize(x)
    return (q.double().reshape(x.shape[0], -1, cpu_int.ACTIVATION_BLOCK) * d.double()[..., None]).reshape(x.shape)


def sqnr_db(reference: torch.Tensor, result: torch.Tensor) -> float:
    noise = (reference.double() - result.double()).pow(2).sum()
    return float(10 * torch.log10(reference.double().pow(2).sum() / noise.clamp_min(1e-300)))


def w4_case(out: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(out, k // group, generator=g) * 0.05 + 0.01
    zeros = torch.randint(0, 16, (out, k // group), generator=g).float()
    weight = (codes.double() - zeros.double().repeat_interleave(group, 1)) * scales.double().repeat_interleave(group, 1)
    return codes, scales, zeros, weight


def w8_case(out: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (out, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(out, 1, generator=g) * 0.01 + 0.001
    zeros = torch.randint(0, 256, (out, 1), generator=g).float()
    return codes, scales, zeros, (codes.double() - zeros.double()) * scales.double()


def inputs(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, :16] *= 20  # blocks of very different ranges, also within a 64-block: each gets its own scale
    x[:, 112:128] *= 0.01
    if k > 128:
        x[:, 128:144] = 0  # an all-zero block (scale 0)
    return x


def test_activations_quantize_as_the_reference():
    x = inputs(3, 256)
    x[1, 168], x[1, 170] = 10.0, 2.5 * 10.0 / 127  # a value halfway between two codes: rounds to even
    ref_q, ref_d = reference_quantize(x)
    for isa in levels():
        q, d = cpu_int.quantize_activations(x, isa)
        assert torch.equal(q, ref_q) and torch.equal(d, ref_d), isa


@pytest.mark.parametrize("rows", [1, 2, 4, 8, 11])
@pytest.mark.parametrize(("k", "group"), [(384, 64), (448, 64), (640, 128), (576, 192)])
@pytest.mark.parametrize("out", [48, 37])
def test_w4_matches_the_dequantized_weight_on_every_isa(rows, k, group, out):
    """Even and odd numbers of 64-blocks; groups of several blocks; output rows filling AVX-512's tiles of 16 and
    not (the last tile padded)."""
    codes, scales, zeros, weight = w4_case(out, k, group)
    x = inputs(rows, k)
    exact = dequantized_x(x) @ weight.t()  # the quantized activations times the dequantized weight
    for isa in levels():
        y = cpu_int.W4A8Linear(codes, scales, zeros, None, isa=isa)(x)
        assert y.shape == (rows, out) and y.dtype == torch.float32
        assert sqnr_db(exact, y) > 100, (isa, sqnr_db(exact, y))  # float32 rounding only
        assert sqnr_db(x.double() @ weight.t(), y) > 30  # and int8 activations stay close to float ones


def test_per_token_activations_quantize_as_w4a8_schemes_do():
    """A W4A8 layer's activations: one scale a row, the codes ``quantize_per_token`` gives (bit for bit), on every
    instruction set level; an all-zero row scale 1 and codes 0."""
    from lmpress.weights.int8_linear import quantize_per_token

    x = inputs(3, 384)
    x[2] = 0
    ref_q, ref_scale = quantize_per_token(x)
    for isa in levels():
        q, d = cpu_int.quantize_activations(x, isa, per_token=True)
        assert torch.equal(q, ref_q) and torch.equal(d, ref_scale.expand_as(d)), isa


@pytest.mark.parametrize("rows", [1, 5, 11])
@pytest.mark.parametrize(("k", "group"), [(384, 64), (448, 64), (576, 192)])
def test_w4_with_per_token_activations_matches_the_w4a8_simulation_on_every_isa(rows, k, group):
    """A W4A8 layer on the kernel: its per-token int8 activations times the dequantized weight, to float32
    rounding, on every level (the t16 layout of AVX-512 VNNI included)."""
    from lmpress.weights.int8_linear import fake_quantize_per_token

    codes, scales, zeros, weight = w4_case(37, k, group)
    x = inputs(rows, k)
    exact = fake_quantize_per_token(x).double() @ weight.t()
    for isa in levels():
        y = cpu_int.W4A8Linear(codes, scales, zeros, None, isa=isa, per_token=True)(x)
        assert sqnr_db(exact, y) > 100, (isa, sqnr_db(exact, y))
        assert sqnr_db(dequantized_x(x) @ weight.t(), y) < 60  # not the per-4 activations of W4A16 layers


@pytest.mark.parametrize("rows", [1, 5, 9])
@pytest.mark.parametrize("out", [80, 37])
def test_w8_with_per_token_activations_computes_w8a8_as_torchs_int8_matmul_on_every_isa(rows, out):
    """A W8A8 layer (symmetric 8-bit weights per row, int8 activations per token) on the kernel: bit for bit what
    ``int8_linear.w8a8_linear`` computes with one exact int32 matmul (torch._int_mm), on every level; so the runtime
    decodes what the evaluator scored."""
    from lmpress.weights.int8_linear import int8_weight, w8a8_linear

    codes, scales, _, weight = w8_case(out, 320)
    zeros = torch.full((out, 1), 128.0)  # symmetric: the codes are int8 weights + 128
    x = inputs(rows, 320) * 40  # large activations: float sums of per-4 products would round differently
    expected = w8a8_linear(x, int8_weight(codes).t().contiguous(), scales[:, 0])
    for isa in [*levels(), 2]:  # an AVX-512 request runs the exact AVX2 path
        layer = cpu_int.W8A8RowLinear(codes, scales, zeros, None, isa=min(isa, cpu_int.host_isa()), per_token=True)
        assert layer.isa <= 1
        assert torch.equal(layer(x), expected), isa
        assert torch.equal(layer.rows(torch.tensor([3, 0]))(x), expected[:, [3, 0]])


def test_w8_per_token_keeps_torchs_bits_in_bfloat16_with_a_bias():
    """The bias is added in float32 before the cast, as ``w8a8_linear`` adds it: a biased W8A8 layer run in bfloat16
    gives ``torch._int_mm``'s bits too."""
    from lmpress.weights.int8_linear import int8_weight, w8a8_linear

    codes, scales, _, _ = w8_case(48, 256)
    bias = torch.randn(48) * 3
    x = (inputs(4, 256) * 10).bfloat16()
    expected = w8a8_linear(x, int8_weight(codes).t().contiguous(), scales[:, 0], bias)
    layer = cpu_int.W8A8RowLinear(codes, scales, torch.full((48, 1), 128.0), bias, per_token=True)
    assert layer(x).dtype == torch.bfloat16
    assert torch.equal(layer(x), expected)


def test_per_token_w8_refuses_widths_its_int32_sums_cannot_hold():
    """Above 65,536 columns a row's int32 sum could overflow: the fit check sends such a W8A8 layer to torch's
    kernel rather than to the op's error; a per-4 layer of that width still fits. The op's own check (the last
    guard for a direct caller) draws the line at the same width as the Python bound."""
    widest = cpu_int.MAX_TOKEN_FEATURES
    assert widest * 127 * 255 < 2**31
    assert cpu_int.w8_fits(widest, widest, act_order=False, per_token=True)
    assert not cpu_int.w8_fits(widest + 64, widest + 64, act_order=False, per_token=True)
    assert cpu_int.w8_fits(widest + 64, widest + 64, act_order=False)
    assert cpu_int.w8a8_product(torch.zeros(2, widest + 64, dtype=torch.uint8), torch.ones(2)) is None
    zeros = torch.full((2, 1), 128.0)
    fits = cpu_int.W8A8RowLinear(torch.full((2, widest), 129, dtype=torch.uint8), torch.ones(2, 1), zeros, None,
                                 per_token=True)  # fmt: skip
    torch.testing.assert_close(fits(torch.ones(1, widest)), torch.full((1, 2), float(widest)))
    wider = cpu_int.W8A8RowLinear(torch.zeros(2, widest + 64, dtype=torch.uint8), torch.ones(2, 1), zeros, None,
                                  per_token=True)  # fmt: skip
    with pytest.raises(RuntimeError, match=f"in_features at most {widest}"):
        wider(torch.ones(1, widest + 64))


def test_w8_per_token_with_zero_points_sums_exactly_against_int64():
    """Asymmetric 8-bit codes (a zero point a row) with per-token int8 activations: float(sum (q - z) * xq) * d * s,
    the sum checked against an int64 matmul of the same codes."""
    from lmpress.weights.int8_linear import quantize_per_token

    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (24, 448), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 256, (24, 1), generator=g).float()
    scales = torch.rand(24, 1, generator=g) * 0.01 + 1e-3
    x = torch.randn(3, 448, generator=g) * 7
    xq, d = quantize_per_token(x)
    dot = xq.long() @ (codes.long() - zeros.long()).t()
    expected = dot.float() * d * scales[:, 0]
    for isa in levels():
        y = cpu_int.W8A8RowLinear(codes, scales, zeros, None, isa=isa, per_token=True)(x)
        assert torch.equal(y, expected), isa


@pytest.mark.parametrize("rows", [1, 3, 8, 9])
@pytest.mark.parametrize("out", [80, 37])
def test_w8_matches_the_dequantized_weight_on_every_isa(rows, out):
    codes, scales, zeros, weight = w8_case(out, 320)
    x = inputs(rows, 320)
    exact = dequantized_x(x) @ weight.t()
    for isa in levels():
        y = cpu_int.W8A8RowLinear(codes, scales, zeros, None, isa=isa)(x)
        assert sqnr_db(exact, y) > 100, (isa, sqnr_db(exact, y))
        assert sqnr_db(x.double() @ weight.t(), y) > 30


def test_extreme_codes_do_not_saturate():
    """All-255 weight codes against +-127 activations: the AVX2 path's int16 pairs would saturate on 255 * 127 * 2."""
    codes = torch.full((16, 128), 255, dtype=torch.uint8)
    codes[::2] = 0
    x = torch.where(torch.arange(128) % 3 == 0, 1.0, -1.0).repeat(2, 1)
    weight = codes.double() - 7
    for isa in levels():
        y = cpu_int.W8A8RowLinear(codes, torch.ones(16, 1), torch.full((16, 1), 7.0), None, isa=isa)(x)
        torch.testing.assert_close(y.double(), x.double() @ weight.t(), rtol=1e-6, atol=1e-3)


def test_several_rows_give_each_rows_own_result():
    """A 5-row product (speculative verification) equals five 1-row products."""
    codes, scales, zeros, _ = w4_case(32, 192, 64)
    x = inputs(5, 192)
    module = cpu_int.W4A8Linear(codes, scales, zeros, torch.randn(32))
    together = module(x.reshape(1, 5, 192))
    apart = torch.stack([module(row[None]) for row in x], dim=1)
    assert together.shape == (1, 5, 32)
    torch.testing.assert_close(together, apart, rtol=0, atol=0)


@pytest.mark.long
def test_compiles_in_one_graph():
    w4 = cpu_int.W4A8Linear(*w4_case(37, 128, 64)[:3], None)
    w8 = cpu_int.W8A8RowLinear(*w8_case(37, 128)[:3], None)
    x = inputs(2, 128)
    compiled = torch.compile(lambda t: w4(t).relu() * 2 + w8(t), fullgraph=True)
    torch.testing.assert_close(compiled(x), w4(x).relu() * 2 + w8(x))


@pytest.mark.long
def test_a_step_compiled_with_the_cpp_wrapper_passes_every_option_to_the_ops():
    """The runtime's compiled CPU step calls the ops from C++ (generate.wrapper_options): every layer computes there
    what it computes eagerly, per 4 values and per token alike. Inductor's C++ wrapper once dropped a bool argument,
    so a per-4 layer read a stale ``per_token`` in the compiled step only."""
    from lmpress.runtime.generate import wrapper_options

    w4, w8, bias = w4_case(40, 128, 64)[:3], w8_case(40, 128)[:3], torch.randn(40)
    layers = [
        cpu_int.W4A8Linear(*w4, None),
        cpu_int.W4A8Linear(*w4, None, per_token=True),
        cpu_int.W8A8RowLinear(*w8, bias),
        cpu_int.W8A8RowLinear(*w8, bias, per_token=True),  # its own tail: the bias added in float32
    ]
    x = inputs(3, 128) * 30  # per-token and per-4 results differ well beyond rounding
    assert not torch.allclose(layers[2](x), layers[3](x), rtol=0, atol=1e-3)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: [layer(t) for layer in layers], options=wrapper_options(torch.device("cpu")))
    for layer, got in zip(layers, compiled(x), strict=True):
        assert torch.equal(got, layer(x)), layer


def test_a_cpu_without_avx2_warns_and_runs_the_portable_path(monkeypatch):
    monkeypatch.setattr(cpu_int, "cpu_isa", lambda: 0)
    cpu_int.host_isa.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no AVX2"):
            module = cpu_int.W4A8Linear(*w4_case(16, 128, 64)[:3], None)
        codes, scales, zeros, weight = w4_case(16, 128, 64)
        x = inputs(1, 128)
        assert module.isa == 0 and sqnr_db(dequantized_x(x) @ weight.t(), module(x)) > 100
    finally:
        cpu_int.host_isa.cache_clear()


def test_without_a_compiler_the_runtime_keeps_torchs_kernels(monkeypatch):
    from lmpress.runtime.kernels.cpu import Int4Linear, cpu_linear
    from lmpress.weights.qlinear import QuantizedLinear
    from lmpress.weights.scheme import QuantScheme

    def no_compiler():
        raise RuntimeError("no C++ compiler")

    layer = QuantizedLinear(128, 32, QuantScheme(bits=4, group_size=64, symmetric=False), bias=False)
    monkeypatch.setattr(cpu_int, "load_library", no_compiler)
    cpu_int.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="did not build"):
            assert isinstance(cpu_linear(layer, torch.float32), Int4Linear)
    finally:
        cpu_int.available.cache_clear()


@pytest.mark.parametrize(("group", "compiler"), [(32, True), (64, False)])
@pytest.mark.parametrize("activations", ["int8", "bf16"])
def test_w4a8_layers_never_take_a_weight_only_kernel(monkeypatch, group, compiler, activations):
    """A W4A8 layer lmpress's int4 x int8 kernel does not hold (groups of 32, or no compiler) runs with its
    activations quantized per token as its scheme says (``Int8ActivationsLinear``), never torch's weight-only int4
    kernel, whatever the runtime's activations for weight-only layers; its outputs are the layer's own."""
    from lmpress.runtime.kernels.cpu import cpu_linear
    from lmpress.runtime.kernels.dense import Int8ActivationsLinear
    from lmpress.weights.qlinear import QuantizedLinear
    from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

    scheme = QuantScheme(bits=4, group_size=group, symmetric=True, activations="int8")
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    layer = QuantizedLinear.from_quantized_weight(quantize_weight_rtn(weight, scheme))
    if not compiler:
        monkeypatch.setattr(cpu_int, "load_library", lambda: (_ for _ in ()).throw(RuntimeError("no C++ compiler")))
    cpu_int.available.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = cpu_linear(layer, torch.float32, activations)
    finally:
        cpu_int.available.cache_clear()
    assert isinstance(module, Int8ActivationsLinear)
    x = inputs(3, 128)
    torch.testing.assert_close(module(x), layer(x), rtol=1e-5, atol=1e-5)


def test_rows_split_over_threads_agree_with_one_thread():
    """Output rows split over 2 threads (the runtime's default here; the autouse fixture runs tests on one):
    each thread reads the activations the calling thread quantized."""
    w4 = cpu_int.W4A8Linear(*w4_case(96, 448, 64)[:3], None)
    w8 = cpu_int.W8A8RowLinear(*w8_case(256, 320)[:3], None)
    x4, x8 = inputs(3, 448), inputs(3, 320)
    one = (w4(x4), w8(x8))
    torch.set_num_threads(2)
    two = (w4(x4), w8(x8))
    torch.testing.assert_close(two, one, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [2, 5, 8])
def test_w8_rows_together_give_each_rows_own_result(rows):
    """The W8 head in a speculative verification: rows summed 4 at a time and a last one alone give the bits of a
    one-row product, on every instruction set level."""
    codes, scales, zeros, _ = w8_case(48, 320)
    x = inputs(rows, 320)
    for isa in levels():
        module = cpu_int.W8A8RowLinear(codes, scales, zeros, None, isa=isa)
        apart = torch.cat([module(row[None]) for row in x])
        torch.testing.assert_close(module(x), apart, rtol=0, atol=0)


def test_w8_cut_to_some_output_rows_computes_those_rows():
    """``rows`` (the head cut to part of the vocabulary) from every layout, the outputs-in-lanes one included."""
    codes, scales, zeros, _ = w8_case(40, 192)
    keep = torch.tensor([0, 17, 3, 39, 16])
    x = inputs(2, 192)
    for isa in levels():
        module = cpu_int.W8A8RowLinear(codes, scales, zeros, torch.randn(40), isa=isa)
        cut = module.rows(keep)
        assert cut.out_features == 5
        torch.testing.assert_close(cut(x), module(x)[:, keep], rtol=0, atol=0)


def test_large_weights_go_to_huge_page_memory_and_compute_the_same(monkeypatch):
    """Weights from HUGE_PAGE_BYTES on are copied into 2 MiB-aligned memory (advised for transparent huge pages):
    the same values, the same outputs, freed with the module."""
    t = torch.randint(0, 256, (3, 1000), dtype=torch.uint8)
    cpu_int.load_library()
    copy = torch.ops.lmpress_cpu.huge_page_copy(t)
    assert torch.equal(copy, t) and copy.data_ptr() % (2 << 20) == 0 and copy.data_ptr() != t.data_ptr()
    codes, scales, zeros, _ = w8_case(37, 192)
    x = inputs(3, 192)
    for isa in levels():
        ordinary = cpu_int.W8A8RowLinear(codes, scales, zeros, None, isa=isa)
        monkeypatch.setattr(cpu_int, "HUGE_PAGE_BYTES", 0)
        huge = cpu_int.W8A8RowLinear(codes, scales, zeros, None, isa=isa)
        monkeypatch.undo()
        assert huge.codes.data_ptr() % (2 << 20) == 0
        torch.testing.assert_close(huge(x), ordinary(x), rtol=0, atol=0)
        del huge
