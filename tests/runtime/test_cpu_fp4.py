"""The FP4 CPU kernel (kernels/cpu_fp4.py, cpu_fp4.cpp) against float64 references of the same math (int8-per-4
activations times the exact FP4 weight), on every instruction set level this host runs; the AVX-512 path also
through SIMDe's portable intrinsics where this host has no AVX-512 (simde-py installed)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from lmpress.runtime.kernels import cpu_fp4, cpu_int
from lmpress.runtime.kernels.cpp_build import build_directory, build_library
from lmpress.weights.fp4 import Fp4Linear, e2m1_values, pack_fp4, unpack_fp4
from lmpress.weights.scheme import QuantScheme

pytestmark = pytest.mark.skipif(not cpu_fp4.available(), reason="the C++ kernels do not build on this host")
BLOCKS = {"nvfp4": 16, "mxfp4": 32}


def levels() -> list[int]:
    return list(range(cpu_int.host_isa() + 1)) if cpu_fp4.available() else []


def dequantized_x(x: torch.Tensor) -> torch.Tensor:
    """What the kernels take ``x`` as, in float64: int8 codes times a scale per 4 (d = max|x| / 127, round half to
    even, in float32 as the kernels)."""
    blocks = x.float().reshape(x.shape[0], -1, 4)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv[..., None]).double() * d.double()[..., None]).reshape(x.shape)


def sqnr_db(reference: torch.Tensor, result: torch.Tensor) -> float:
    noise = (reference.double() - result.double()).pow(2).sum()
    return float(10 * torch.log10(reference.double().pow(2).sum() / noise.clamp_min(1e-300)))


def scale_value(fmt: str, scale_bytes: torch.Tensor) -> torch.Tensor:
    if fmt == "nvfp4":
        return scale_bytes.view(torch.float8_e4m3fn).double()
    return torch.exp2(scale_bytes.double() - 127)


def fp4_layer(fmt: str, out: int, k: int, bias: bool = False, seed: int = 0) -> tuple[Fp4Linear, torch.Tensor]:
    """A layer with random codes (every one of the 16), random scale bytes (NVFP4: every non-negative finite E4M3
    value, subnormals too; MXFP4: 2^-17 to 2^12) and its exact float64 weight."""
    g = torch.Generator().manual_seed(seed)
    block = BLOCKS[fmt]
    codes = torch.randint(0, 16, (out, k), generator=g, dtype=torch.uint8)
    if fmt == "nvfp4":
        scales = torch.randint(0, 0x7F, (out, k // block), generator=g, dtype=torch.uint8)
    else:
        scales = torch.randint(110, 140, (out, k // block), generator=g, dtype=torch.uint8)
    layer = Fp4Linear(k, out, QuantScheme(4, block, True, fp4=fmt), bias=bias)
    layer.weight_packed.copy_(pack_fp4(codes))
    layer.weight_scale.copy_(scales.view(layer.weight_scale.dtype))
    weight = e2m1_values(codes).double() * scale_value(fmt, scales).repeat_interleave(block, 1)
    if fmt == "nvfp4":
        layer.weight_global_scale.fill_(37.5)
        weight = weight / 37.5
    if bias:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(out, generator=g))
    return layer.requires_grad_(False), weight


def inputs(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, :16] *= 20  # blocks of very different ranges, also within a superblock
    x[:, 112:128] *= 0.01
    if k > 128:
        x[:, 128:144] = 0  # an all-zero activation block (scale 0)
    return x


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 11])
@pytest.mark.parametrize(("out", "k"), [(48, 576), (37, 192), (5, 256)])
def test_matches_the_reference_on_every_isa(fmt, rows, out, k):
    """Odd and even numbers of 64-column superblocks; output rows filling AVX-512's tiles of 16 and not (padded);
    more rows than one pass of 8."""
    layer, weight = fp4_layer(fmt, out, k)
    x = inputs(rows, k)
    exact = dequantized_x(x) @ weight.t()  # the quantized activations times the exact FP4 weight
    for isa in levels():
        y = cpu_fp4.Fp4A8Linear.from_layers([layer], isa)(x)
        assert y.shape == (rows, out) and y.dtype == torch.float32
        assert sqnr_db(exact, y) > 100, (isa, sqnr_db(exact, y))  # float32 rounding only


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_int8_activations_cost_what_their_rounding_does(fmt):
    """Against the float product (float activations, the dequantized weight): the error is the activations' int8
    rounding carried through a random weight, so the product's SQNR stays within a few dB of the activations' own
    (and past 30 dB, the W4 kernels' bound), with a bias and a batch of leading dimensions."""
    layer, weight = fp4_layer(fmt, 70, 576, bias=True)
    x = inputs(6, 576)
    float_product = x.double() @ weight.t() + layer.bias.double()
    activations_db = sqnr_db(x, dequantized_x(x))
    module = cpu_fp4.fp4_cpu_module(layer)
    assert module is not None and module.KERNEL == "cpu-fp4a8"
    y = module(x.reshape(2, 3, 576))
    assert y.shape == (2, 3, 70)
    db = sqnr_db(float_product, y.reshape(6, 70))
    assert db > max(30.0, activations_db - 6), (db, activations_db)
    torch.testing.assert_close(layer(x), y.reshape(6, 70), rtol=0.05, atol=0.05 * float(y.abs().max()))


def test_quantized_weights_from_the_library_run_the_same():
    """A weight quantized by lmpress (min/max scales) through ``fp4_cpu_module``, against Fp4Linear's own forward."""
    from lmpress.weights.fp4 import quantize_weight_fp4

    w = torch.randn(64, 320, generator=torch.Generator().manual_seed(3)) * 0.02
    x = inputs(3, 320)
    for fmt, block in BLOCKS.items():
        layer = Fp4Linear.from_weight(quantize_weight_fp4(w, QuantScheme(4, block, True, fp4=fmt)))
        exact = dequantized_x(x) @ layer.dequantized_weight().double().t()
        assert sqnr_db(exact, cpu_fp4.fp4_cpu_module(layer)(x)) > 100


def test_extreme_codes_do_not_saturate():
    """Codes of +-6 (u = 24 and 0) against +-127 activation codes: the AVX2 path's int16 pairs hold 2 * 24 * 127."""
    for fmt in BLOCKS:
        layer, _ = fp4_layer(fmt, 16, 128)
        codes = torch.full((16, 128), 7, dtype=torch.uint8)
        codes[::2] = 15
        layer.weight_packed.copy_(pack_fp4(codes))
        weight = e2m1_values(codes).double() * scale_value(fmt, cpu_fp4.scale_bytes(layer)).repeat_interleave(
            BLOCKS[fmt], 1
        )
        if fmt == "nvfp4":
            weight = weight / 37.5
        x = torch.where(torch.arange(128) % 3 == 0, 1.0, -1.0).repeat(2, 1)
        for isa in levels():
            y = cpu_fp4.Fp4A8Linear.from_layers([layer], isa)(x)
            assert sqnr_db(x.double() @ weight.t(), y) > 100, isa


def test_several_rows_give_each_rows_own_result():
    """A 5-row product (speculative verification) equals five 1-row products, bit for bit."""
    layer, _ = fp4_layer("nvfp4", 40, 192, bias=True)
    module = cpu_fp4.fp4_cpu_module(layer)
    x = inputs(5, 192)
    together = module(x.reshape(1, 5, 192))
    apart = torch.stack([module(row[None]) for row in x], dim=1)
    torch.testing.assert_close(together, apart, rtol=0, atol=0)


def test_rows_split_over_threads_agree_with_one_thread():
    layer, _ = fp4_layer("mxfp4", 96, 448)
    module = cpu_fp4.fp4_cpu_module(layer)
    x = inputs(3, 448)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = module(x)
        torch.set_num_threads(2)
        two = module(x)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(two, one, rtol=0, atol=0)


def test_fused_layers_keep_each_their_global_scale():
    """q/k/v as one module: rows concatenated, each layer's NVFP4 global scale a factor of its own rows."""
    layers = [fp4_layer("nvfp4", out, 128, bias=i == 1, seed=i)[0] for i, out in enumerate((32, 16, 16))]
    for i, layer in enumerate(layers):
        layer.weight_global_scale.fill_(10.0 * (i + 1))
    fused = cpu_fp4.fp4_cpu_fused(layers)
    x = inputs(2, 128)
    apart = torch.cat([cpu_fp4.fp4_cpu_module(layer)(x) for layer in layers], dim=-1)
    torch.testing.assert_close(fused(x), apart, rtol=0, atol=0)
    mixed = [layers[0], fp4_layer("mxfp4", 16, 128)[0]]
    assert cpu_fp4.fp4_cpu_fused(mixed) is None


def test_refuses_what_it_cannot_run():
    nv = QuantScheme(4, 16, True, fp4="nvfp4")
    assert cpu_fp4.fp4_cpu_module(nn.Linear(64, 16)) is None
    w4a4 = Fp4Linear(64, 16, QuantScheme(4, 16, True, fp4="nvfp4", activations="fp4"))
    assert cpu_fp4.fp4_cpu_module(w4a4) is None and "W4A4" in cpu_fp4.refusal(w4a4)
    assert cpu_fp4.fp4_cpu_module(Fp4Linear(80, 16, nv)) is None  # blocks of 16 fit, superblocks of 64 do not
    negative, _ = fp4_layer("nvfp4", 16, 64)
    negative.weight_scale.view(torch.uint8)[0, 0] = 0xB8  # -1.0
    assert cpu_fp4.fp4_cpu_module(negative) is None
    for byte in (0, 255):  # MXFP4's 2^-127 and NaN
        mx, _ = fp4_layer("mxfp4", 16, 64)
        mx.weight_scale[3, 1] = byte
        assert cpu_fp4.fp4_cpu_module(mx) is None
    assert cpu_fp4.fp4_cpu_module(fp4_layer("mxfp4", 16, 64)[0]) is not None


def test_compiles_in_one_graph():
    module = cpu_fp4.fp4_cpu_module(fp4_layer("nvfp4", 37, 128, bias=True)[0])
    x = inputs(2, 128)
    compiled = torch.compile(lambda t: module(t).relu() * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), module(x).relu() * 2)
    codes, scales, rows = module.codes, module.scales, module.row_scale
    op = torch.ops.lmpress_cpu.fp4_linear_t16 if module.isa == 2 else torch.ops.lmpress_cpu.fp4_linear
    last = module.out_features if module.isa == 2 else module.isa
    torch.library.opcheck(op.default, (x, codes, scales, rows, 16, last))


# The AVX-512 path through SIMDe ---------------------------------------------------------------------------------


@functools.cache
def simde_ops():
    """cpu_fp4.cpp built with SIMDe's AVX-512 (ops ``torch.ops.lmpress_cpu_simde``), or None without simde-py."""
    try:
        import simde_py
    except ImportError:
        return None
    source = cpu_fp4.SOURCE
    text = source.read_bytes() + source.with_name("cpu_quantize_acts.h").read_bytes()  # the source and its header
    name, build = build_directory("lmpress_cpu_fp4_simde", text)
    flags = ["-O1", "-std=c++17", "-DLMPRESS_FP4_SIMDE", "-DLMPRESS_FP4_NAMESPACE=lmpress_cpu_simde"]
    includes = [simde_py.get_include()]
    build_library(name, [source], build, flags, "the FP4 kernels over SIMDe", extra_include_paths=includes)
    return torch.ops.lmpress_cpu_simde


@pytest.mark.skipif(cpu_int.available() and cpu_int.host_isa() == 2, reason="this host runs AVX-512 itself")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_avx512_path_through_simde(fmt):
    ops = simde_ops()
    if ops is None:
        pytest.skip("simde-py is not installed (pip install simde-py)")
    for rows, out, k in ((1, 48, 576), (4, 37, 192), (9, 5, 256)):
        layer, weight = fp4_layer(fmt, out, k, seed=rows)
        x = inputs(rows, k)
        codes, scales, row_scale = cpu_fp4.repack_fp4_t16(
            unpack_fp4(layer.weight_packed),
            cpu_fp4.scale_bytes(layer),
            cpu_fp4.row_scales(layer),
        )
        y = ops.fp4_linear_t16(x, codes, scales, row_scale, BLOCKS[fmt], out)
        db = sqnr_db(dequantized_x(x) @ weight.t(), y)
        assert y.shape == (rows, out) and db > 100, (rows, out, k, db)
