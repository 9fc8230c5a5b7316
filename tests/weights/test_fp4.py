"""FP4 (NVFP4, MXFP4) weights against compressed-tensors, the reference implementation vLLM's checkpoints follow."""

import pytest
import torch

from lmpress.weights.fp4 import (
    E2M1_VALUES,
    FP4_BLOCK,
    Fp4Linear,
    decode_e8m0,
    e2m1_values,
    encode_e8m0,
    fake_quantize_fp4_activations,
    pack_fp4,
    quantize_weight_fp4,
    round_to_e2m1,
    unpack_fp4,
)
from lmpress.weights.scheme import QuantScheme

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4  # noqa: E402

COMPRESSORS = {"nvfp4": (NVFP4PackedCompressor, "NVFP4A16"), "mxfp4": (MXFP4PackedCompressor, "MXFP4A16")}


def scheme(fmt: str, activations: str | None = None) -> QuantScheme:
    return QuantScheme(4, FP4_BLOCK[fmt], True, activations, fp4=fmt)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    return float(10 * torch.log10(reference.pow(2).sum() / (reference - approx).pow(2).sum()))


def test_e2m1_rounding_matches_compressed_tensors_including_ties():
    grid = torch.tensor(E2M1_VALUES)
    midpoints = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([torch.linspace(-7, 7, 2001), midpoints, -midpoints, grid, -grid])
    ours = e2m1_values(round_to_e2m1(x.clamp(-6, 6)))
    torch.testing.assert_close(ours, cast_to_fp4(x.clone().clamp(-6, 6)), atol=0, rtol=0)


def test_pack_roundtrip_and_nibble_order():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_fp4(codes)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == int(codes[0, 0]) | (int(codes[0, 1]) << 4)
    assert torch.equal(unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="even number"):
        pack_fp4(codes[:, :63])


def test_e8m0_roundtrip_and_nan():
    scales = torch.exp2(torch.arange(-20, 20, dtype=torch.float32))
    assert torch.equal(decode_e8m0(encode_e8m0(scales)), scales)
    assert torch.isnan(decode_e8m0(torch.tensor([255], dtype=torch.uint8)))[0]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_minmax_scales_match_compressed_tensors_observer(fmt):
    """Without the scale search, lmpress's RTN picks the scales compressed-tensors' min/max observer picks."""
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    q = quantize_weight_fp4(w, scheme(fmt), mse=False)
    args = preset_name_to_scheme(COMPRESSORS[fmt][1], ["Linear"]).weights
    blocks = w.reshape(32, -1, FP4_BLOCK[fmt])
    global_scale = generate_gparam(w.min(), w.max()) if fmt == "nvfp4" else None
    theirs, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=global_scale)
    torch.testing.assert_close(q.scales, theirs.float(), atol=0, rtol=0)
    if fmt == "nvfp4":
        torch.testing.assert_close(q.global_scale, global_scale, atol=0, rtol=0)


@pytest.mark.parametrize("mse", [False, True])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_packed_bytes_are_what_compressed_tensors_writes(fmt, mse):
    """Byte for byte: compressed-tensors' own compressor, given our dequantized values and scales, writes our
    weight_packed and weight_scale; its decompressor gives our values back (within its bfloat16 output)."""
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(2))
    q = quantize_weight_fp4(w, scheme(fmt), mse=mse)
    layer = Fp4Linear.from_weight(q)
    compressor, preset = COMPRESSORS[fmt]
    state = {"weight": q.dequantize(), "weight_scale": q.scales}
    if fmt == "nvfp4":
        state["weight_global_scale"] = q.global_scale
    theirs = compressor.compress(state, preset_name_to_scheme(preset, ["Linear"]))
    assert torch.equal(theirs["weight_packed"], layer.weight_packed)
    assert torch.equal(theirs["weight_scale"].view(torch.uint8), layer.weight_scale.view(torch.uint8))
    back = compressor.decompress(theirs, preset_name_to_scheme(preset, ["Linear"]))["weight"]
    torch.testing.assert_close(back.float(), q.dequantize().to(torch.bfloat16).float(), atol=0, rtol=0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_mse_scale_search_never_worse_and_usually_better(fmt):
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(3))
    w[:, ::37] *= 4  # a few larger weights per block, as real layers have
    plain = quantize_weight_fp4(w, scheme(fmt), mse=False).dequantize()
    searched = quantize_weight_fp4(w, scheme(fmt), mse=True).dequantize()
    per_row_plain = (plain - w).pow(2).sum(1)
    per_row_searched = (searched - w).pow(2).sum(1)
    assert bool((per_row_searched <= per_row_plain + 1e-6).all())
    # NVFP4 searches ~10 E4M3 values per block; MXFP4 only the powers of two either side (measured: +0.09 dB)
    assert sqnr_db(w, searched) > sqnr_db(w, plain) + (0.1 if fmt == "nvfp4" else 0.0)
    # 4-bit floats with block scales: about 18-20 dB on Gaussian weights (int4 g32 RTN gives about 19)
    assert sqnr_db(w, searched) > 16


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_linear_forward_equals_dequantized_matmul(fmt):
    torch.manual_seed(4)
    w, x, bias = torch.randn(24, 64), torch.randn(3, 5, 64), torch.randn(24)
    q = quantize_weight_fp4(w, scheme(fmt), mse=True)
    layer = Fp4Linear.from_weight(q, bias)
    torch.testing.assert_close(layer(x), x @ q.dequantize().T + bias)
    assert torch.equal(layer.dequantized_weight(), q.dequantize())  # from the packed bytes, bit for bit
    back = layer.unpack()
    assert torch.equal(back.codes, q.codes) and torch.equal(back.scales, q.scales)
    layer.to(torch.bfloat16)  # scales keep their encoding; the forward follows the input's dtype
    assert layer.weight_scale.dtype == Fp4Linear(64, 24, scheme(fmt)).weight_scale.dtype
    assert layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_activation_quantization_matches_compressed_tensors(fmt):
    """W4A4: per-block activation quantization equals compressed-tensors' dynamic (local) activation QDQ."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(5)) * 3
    args = preset_name_to_scheme(fmt.upper(), ["Linear"]).input_activations
    gs = generate_gparam(x.min(), x.max()) if fmt == "nvfp4" else None
    module = torch.nn.Module()
    scale, zero = compute_dynamic_scales_and_zp(value=x, args=args, module=module, global_scale=gs)
    theirs = fake_quantize(x=x, scale=scale, zero_point=zero, args=args, global_scale=gs)
    ours = fake_quantize_fp4_activations(x, fmt, gs)
    torch.testing.assert_close(ours, theirs.float(), atol=1e-6, rtol=1e-6)


def test_scheme_refuses_groups_the_format_does_not_define():
    with pytest.raises(ValueError, match="nvfp4 defines blocks of 16"):
        QuantScheme(4, 32, True, fp4="nvfp4")
    with pytest.raises(ValueError, match="mxfp4 defines blocks of 32"):
        QuantScheme(4, 16, True, fp4="mxfp4")
    with pytest.raises(ValueError, match="need FP4 weights"):
        QuantScheme(4, 32, True, "fp4")
    assert scheme("nvfp4", "fp4").describe().startswith("NVFP4")
    assert "A16" in scheme("mxfp4").describe()
