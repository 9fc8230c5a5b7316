"""KV-cache value types (lmpress.weights.kv_quant): codes and scales against an independent reference, the error
bound each scheme keeps (SQNR), and the property the evaluator relies on (quantizing a dequantized entry again
gives it back)."""

from __future__ import annotations

import pytest
import torch

from lmpress.weights.kv_quant import (
    KVScheme,
    cache_bytes_per_token,
    dequantize_key_groups,
    dequantize_kv,
    fake_quantize_keys,
    fake_quantize_kv,
    fake_quantize_values,
    fp8_scale_from_amax,
    quantize_key_groups,
    quantize_kv,
)

SCHEMES = [KVScheme("int8", "token"), KVScheme("int4", "token"), KVScheme("fp8", "tensor"), KVScheme("fp8", "head")]


def entries(seed: int = 0) -> torch.Tensor:
    """Keys-like entries ``(batch 2, kv_heads 3, tokens 7, width 64)``: heads of different sizes, one outlier
    channel (what RoPE'd keys look like)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 7, 64, generator=g) * torch.tensor([0.5, 2.0, 8.0]).view(1, 3, 1, 1)
    x[..., 5] *= 6
    return x


def static_scale(x: torch.Tensor, scheme: KVScheme) -> torch.Tensor | None:
    if scheme.scales == "token":
        return None
    amax = x.abs().amax((0, 2, 3))
    return fp8_scale_from_amax(amax.amax().reshape(1) if scheme.scales == "tensor" else amax)


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum()))


def test_int8_codes_and_scales_are_the_per_token_head_absmax_rounding():
    x = entries()
    codes, scales = quantize_kv(x, KVScheme("int8", "token"))
    assert codes.dtype == torch.int8 and scales.shape == (2, 3, 7, 1)
    for b, h, t in [(0, 0, 0), (1, 2, 6), (0, 1, 3)]:
        v = x[b, h, t].double()
        s = v.abs().max() / 127
        assert scales[b, h, t, 0].item() == pytest.approx(s.item(), rel=1e-6)
        assert torch.equal(codes[b, h, t].long(), torch.round(v / s).long())
    assert int(codes.abs().max()) == 127


def test_fp8_codes_are_torchs_e4m3_cast_of_x_over_the_static_scale():
    x = entries()
    scheme = KVScheme("fp8", "head")
    scale = static_scale(x, scheme)
    codes, _ = quantize_kv(x, scheme, scale)
    expected = (x / scale.view(1, 3, 1, 1)).to(torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))
    assert float(codes.float().abs().amax()) == 448.0  # the calibrated amax maps to E4M3's largest value


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.dtype}-{s.scales}")
def test_each_scheme_keeps_its_error_bound_and_is_idempotent(scheme):
    x = entries()
    scale = static_scale(x, scheme)
    y = fake_quantize_kv(x, scheme, scale)
    error = (x - y).abs()
    if scheme.dtype == "int8":  # a uniform grid: within half a step of the token's scale
        bound = x.abs().amax(-1, keepdim=True) / 127 / 2
    elif scheme.dtype == "int4":  # 16 levels from the token's minimum to its maximum (float16 step: +0.1%)
        span = x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)
        bound = span / 15 / 2 * 1.002
    else:  # E4M3, 3 mantissa bits: half an ulp, 2^-4 relative; below 2^-6 (subnormal) half of 2^-9, absolute
        s = scale.view(1, -1, 1, 1)
        bound = torch.maximum(x.abs() * 2**-4, s * 2**-10)
    assert (error <= bound * (1 + 1e-6)).all()
    assert sqnr_db(x, y) > {"int8": 35.0, "int4": 12.0, "fp8": 25.0}[scheme.dtype]  # and well inside on average
    assert torch.equal(fake_quantize_kv(y, scheme, scale), y)
    codes, s = quantize_kv(x, scheme, scale)
    assert torch.equal(dequantize_kv(codes, s, scheme, torch.float32), y)


def test_int4_codes_are_packed_two_a_byte_against_the_stored_float16_step_and_minimum():
    x = entries()
    codes, scales = quantize_kv(x, KVScheme("int4", "token"))
    assert codes.dtype == torch.uint8 and codes.shape == (2, 3, 7, 32) and scales.dtype == torch.float16
    v = x[1, 2, 4].double()
    step, low = scales[1, 2, 4].double()
    assert step.item() == pytest.approx(((v.max() - v.min()) / 15).item(), rel=1e-3)
    assert low.item() == pytest.approx(v.min().item(), rel=1e-3)
    want = torch.round((v - low) / step).clamp(0, 15).long()
    got = torch.stack([codes[1, 2, 4] & 15, codes[1, 2, 4] >> 4], -1).flatten().long()
    assert torch.equal(got, want) and int(want.min()) == 0 and int(want.max()) == 15


def test_grouped_keys_take_a_step_and_minimum_per_channel_over_each_group_of_32_tokens():
    """KIVI's keys: a channel's 32 tokens share one float16 step and minimum; codes packed two a byte as per token."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, 16, generator=g) * torch.linspace(0.1, 8, 16)  # channels of very different range
    codes, scales = quantize_key_groups(x)
    assert codes.shape == (2, 3, 64, 8) and scales.shape == (2, 3, 2, 2, 16) and scales.dtype == torch.float16
    channel = x[1, 2, 32:64, 5].double()  # the second group of one channel
    step, low = scales[1, 2, 1, :, 5].double()
    assert step.item() == pytest.approx(((channel.max() - channel.min()) / 15).item(), rel=1e-3)
    assert low.item() == pytest.approx(channel.min().item(), rel=1e-3)
    want = torch.round((channel - low) / step).clamp(0, 15).long()
    packed = codes[1, 2, 32:64, 2]  # channels 4 (low nibble) and 5 (high)
    assert torch.equal((packed >> 4).long(), want) and int(want.min()) == 0 and int(want.max()) == 15
    y = dequantize_key_groups(codes, scales, torch.float32)
    span = x.view(2, 3, 2, 32, 16).amax(3, keepdim=True) - x.view(2, 3, 2, 32, 16).amin(3, keepdim=True)
    bound = (span / 15 / 2 * 1.002).expand(2, 3, 2, 32, 16).reshape(x.shape)
    assert ((x - y).abs() <= bound).all()
    per_token = fake_quantize_kv(x, KVScheme("int4", "token"))
    small = slice(0, 8)  # the narrow channels keep their precision, where per token the wide ones set the step
    assert sqnr_db(x[..., small], y[..., small]) > sqnr_db(x[..., small], per_token[..., small]) + 5


def test_grouped_keys_of_a_sequence_keep_the_unfinished_group_in_float():
    scheme = KVScheme("int4", "channel")
    x = entries()  # 7 tokens: no whole group
    assert torch.equal(fake_quantize_keys(x, scheme), x)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, 75, 32, generator=g)
    y = fake_quantize_keys(x, scheme)
    assert torch.equal(y[:, :, 64:], x[:, :, 64:])
    assert torch.equal(y[:, :, :64], dequantize_key_groups(*quantize_key_groups(x[:, :, :64]), torch.float32))
    assert torch.equal(fake_quantize_values(x, scheme), fake_quantize_kv(x, KVScheme("int4", "token")))
    with pytest.raises(ValueError, match="quantize_key_groups"):
        quantize_kv(x, scheme)


def test_an_uncalibrated_fp8_cache_takes_scale_one_as_vllm_does():
    x = entries()
    y = fake_quantize_kv(x, KVScheme("fp8", "tensor"))
    assert torch.equal(y, x.to(torch.float8_e4m3fn).float())


def test_a_token_of_zeros_round_trips_to_zeros():
    x = torch.zeros(1, 1, 2, 8)
    for scheme in SCHEMES:
        assert torch.equal(fake_quantize_kv(x, scheme, static_scale(x, scheme)), x)


def test_schemes_refuse_scales_they_do_not_have():
    with pytest.raises(ValueError, match="int8 KV cache takes scales token"):
        KVScheme("int8", "tensor")
    with pytest.raises(ValueError, match="fp8 KV cache takes scales tensor or head"):
        KVScheme("fp8", "token")


def test_bytes_per_token_of_smollm2_shapes():
    # 30 layers x 3 KV heads x 64 wide, keys and values
    assert cache_bytes_per_token(None, 30, 3, 64, 64, 2) == 23040  # bfloat16
    assert cache_bytes_per_token(KVScheme("fp8", "tensor"), 30, 3, 64, 64, 4) == 11520  # 0.5x bf16
    assert cache_bytes_per_token(KVScheme("int8", "token"), 30, 3, 64, 64, 4) == 12240  # codes + a float32 scale
    assert cache_bytes_per_token(KVScheme("int4", "token"), 30, 3, 64, 64, 4) == 6480  # 0.28x bf16
    # grouped keys: 32 code bytes and a float16 step and minimum per channel shared by 32 tokens; values per token
    assert cache_bytes_per_token(KVScheme("int4", "channel"), 30, 3, 64, 64, 4) == 30 * 3 * (32 + 8 + 36)  # 0.297x
