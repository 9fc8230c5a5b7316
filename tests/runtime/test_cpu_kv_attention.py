"""lmpress's AVX2 / AVX-512 attention over a cache of float32 entries or int8, FP8 or INT4 codes
(kernels/cpu_kv_attention.py) against a float64 softmax over the dequantized cache, and the compiled step's use of
it."""

from __future__ import annotations

import pytest
import torch

from lmpress.runtime.grouped_keys import RING, grouped_length
from lmpress.runtime.kernels import cpu_kv_attention
from lmpress.runtime.kv_cache import StaticSlots, static_slots_mask
from lmpress.weights.kv_quant import (
    KEY_GROUP,
    KVScheme,
    dequantize_key_groups,
    dequantize_kv,
    fp8_scale_from_amax,
    quantize_key_groups,
    quantize_kv,
)
from tests.runtime.test_cpu_attention import case, reference

pytestmark = pytest.mark.skipif(not cpu_kv_attention.available(), reason="needs the C++ library and AVX2")
INT8 = KVScheme("int8", "token")


def as_codes(x: torch.Tensor, scheme: KVScheme = INT8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (int8; FP8 under a static scale per KV head or per tensor from the entries' maxima; INT4 two a byte),
    their scales (INT4: float16 step and minimum per slot) and what they dequantize to."""
    scale = None
    if scheme.dtype == "fp8":
        amax = x.abs().amax(dim=(0, 2, 3)) if scheme.scales == "head" else x.abs().amax().reshape(1)
        scale = fp8_scale_from_amax(amax)
    codes, scales = quantize_kv(x, scheme, scale)
    return codes, scales, dequantize_kv(codes, scales, scheme, torch.float32)


STORED = {
    "int8": INT8,
    "fp8-head": KVScheme("fp8", "head"),
    "fp8-tensor": KVScheme("fp8", "tensor"),
    "int4": KVScheme("int4", "token"),
}


def host_runs(isa: int) -> bool:
    """Whether this CPU runs the op's instruction set level ``isa`` (2 AVX-512, 1 AVX2)."""
    from lmpress.runtime.kernels import cpu_int

    return cpu_int.host_isa() >= isa


ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not host_runs(isa), reason="no such CPU")) for isa in (1, 2)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("heads", "kv_heads", "n"), [(9, 3, 1), (9, 3, 3), (8, 1, 3), (2, 2, 2)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("stored", ["float32", "int8", "fp8-head", "fp8-tensor", "int4"])
def test_matches_a_float64_softmax_over_the_visible_slots(heads, kv_heads, n, window, stored, isa):
    """Two rows (the second left padded by 7), query heads on fewer KV heads (a group's rows, heads x queries, go
    4 at a time: 3, 9 and 24 rows), queries ending at slot 600 of 700 (three chunks of 256 slots, the last never
    read: its slots hold 1e4 that any weight on them would show), on each instruction set this CPU runs."""
    q, keys, values = case(2, heads, kv_heads, n, 700, 64, 64)
    keys[:, :, 601:] = 1e4
    pos = torch.arange(601 - n, 601)
    mask = static_slots_mask(torch.tensor([0, 7]), pos, 700, window)
    if stored != "float32":
        (keys, k_scales, k_read), (values, v_scales, v_read) = (as_codes(x, STORED[stored]) for x in (keys, values))
        out = cpu_kv_attention.kv_slots_attention(q, keys, values, mask, 0.125, k_scales, v_scales, isa=isa)
    else:
        k_read, v_read = keys, values
        out = cpu_kv_attention.kv_slots_attention(q, keys, values, mask, 0.125, isa=isa)
    assert out.dtype == torch.float32 and out.shape == (2, heads, n, 64)
    torch.testing.assert_close(out.double(), reference(q, k_read, v_read, mask, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dim", [16, 32, 48, 96, 128])
def test_every_head_width_it_takes(dim, isa):
    q, keys, values = case(1, 4, 2, 2, 300, dim, dim, seed=dim)
    mask = static_slots_mask(torch.tensor([0]), torch.tensor([290, 291]), 300, None)
    out = cpu_kv_attention.kv_slots_attention(q, keys, values, mask, dim**-0.5, isa=isa)
    torch.testing.assert_close(out.double(), reference(q, keys, values, mask, dim**-0.5), rtol=1e-5, atol=1e-5)
    for scheme in STORED.values():
        (codes, k_scales, k_read), (v_codes, v_scales, v_read) = as_codes(keys, scheme), as_codes(values, scheme)
        out = cpu_kv_attention.kv_slots_attention(q, codes, v_codes, mask, dim**-0.5, k_scales, v_scales, isa=isa)
        expected = reference(q, k_read, v_read, mask, dim**-0.5)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def kivi_case(n: int, last: int) -> tuple:
    """Queries, KIVI's cache as the compiled step leaves it after writing slot ``last`` (codes, group scales, value
    codes and scales, the float ring: the unfinished group's codes and every other ring entry garbage), what it
    holds dequantized (keys, values), the step's slots and mask: two rows, the second left padded by 7, 9 query
    heads on 3 KV heads of 64, 700 slots."""
    q, keys, values = case(2, 9, 3, n, 700, 64, 64, seed=last)
    end = last + 1
    whole = end // KEY_GROUP * KEY_GROUP
    codes, scales = quantize_key_groups(torch.cat((keys, torch.randn(2, 3, grouped_length(700) - 700, 64)), 2))
    read = dequantize_key_groups(codes, scales, torch.float32)[:, :, :700]
    read[:, :, whole:end] = keys[:, :, whole:end]
    codes[:, :, whole:] = 0x5A
    recent = torch.full((2, 3, RING, 64), 1e4)
    ring = torch.arange(whole, end)
    recent[:, :, ring % RING] = keys[:, :, ring]
    v_codes, v_scales, v_read = as_codes(values, STORED["int4"])
    pos = torch.arange(end - n, end)
    mask = static_slots_mask(torch.tensor([0, 7]), pos, 700, None)
    return q, (codes, scales, v_codes, v_scales, recent), (read, v_read), pos, mask


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("n", "last"), [(1, 600), (3, 600), (2, 576), (1, 575), (4, 31), (1, 12)])
def test_int4_keys_by_groups_read_codes_up_to_the_unfinished_group_and_its_floats_from_the_ring(n, last, isa):
    """KIVI's cache as the compiled step leaves it: whole groups of 32 slots as codes with a step and minimum per
    channel and group, the unfinished group (from the last whole group boundary before the step's last slot + 1)
    only in the float ring (its codes, and every other ring entry, garbage), values per token; two rows, the second
    left padded by 7, 9 query heads on 3 KV heads, chunks that split groups."""
    q, (codes, scales, v_codes, v_scales, recent), (read, v_read), pos, mask = kivi_case(n, last)
    out = cpu_kv_attention.kv_slots_attention(q, codes, v_codes, mask, 0.125, scales, v_scales, isa, recent, pos)
    torch.testing.assert_close(out.double(), reference(q, read, v_read, mask, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_every_fp8_code_reads_as_torch_casts_it(isa):
    """All 254 finite E4M3 codes (subnormals, both zeros, +-448) as keys of one slot each: the op's score for a
    one-hot query is exactly the code's value (torch's cast), whatever denormal flushing the CPU is set to."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # without the two NaNs
    values = codes.float()
    keys = torch.zeros(1, 1, len(codes), 16, dtype=torch.float8_e4m3fn)
    keys[0, 0, :, 0] = codes
    q = torch.zeros(1, 1, 1, 16)
    q[..., 0] = 1.0
    mask = torch.zeros(1, 1, 1, len(codes), dtype=torch.bool)
    one = torch.ones(1)
    for slot in (0, 5, 120, len(codes) - 1):  # each code alone, then the value it weights is that code's row
        mask.zero_()
        mask[..., slot] = True
        out = cpu_kv_attention.kv_slots_attention(q, keys, keys, mask, 1.0, one, one, isa=isa)
        assert out[0, 0, 0, 0].item() == values[slot].item()
    # every code's score: a softmax of 2 slots (the code and a 0) gives sigmoid(value) weights on known values
    for slot in range(len(codes)):
        mask.zero_()
        mask[..., slot] = True
        mask[..., 0] = True  # code 0: +0.0
        out = cpu_kv_attention.kv_slots_attention(q, keys, keys, mask, 1.0, one, one, isa=isa)
        v = values[slot].double()
        expected = 0.0 if slot == 0 else (torch.sigmoid(v) * v).item()
        assert out[0, 0, 0, 0].item() == pytest.approx(expected, rel=1e-5, abs=1e-30), slot


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("slots", "pad", "last"),
    [(64, 0, 61), (100, 0, 97), (256, 0, 253), (528, 0, 191), (528, 37, 300), (1200, 0, 1100), (40, 0, 0)],
)
def test_any_split_of_the_slots_over_threads_gives_the_same_attention(threads, slots, pad, last):
    """The work items split the slots the query sees (``pad`` to ``last``), not the cache: a decode step of 3 KV
    heads over 192 of 528 slots is 4 chunks a head on 2 threads (6 items each), and spans past 4 x 256 slots take
    more chunks; every split merges to the softmax."""
    q, keys, values = case(1, 9, 3, 1, slots, 64, 64, seed=slots + pad)
    mask = static_slots_mask(torch.tensor([pad]), torch.tensor([last]), slots, None)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = cpu_kv_attention.kv_slots_attention(q, keys, values, mask, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), reference(q, keys, values, mask, 0.125), rtol=1e-5, atol=1e-5)


def test_extreme_scores_neither_overflow_nor_vanish():
    """Scores hundreds apart, and apart across chunks: each chunk's maximum, then the merge's, subtracted first."""
    q, keys, values = case(1, 2, 1, 1, 600, 16, 16, seed=5)
    q *= 200
    mask = torch.ones(1, 1, 1, 600, dtype=torch.bool)
    out = cpu_kv_attention.kv_slots_attention(q, keys, values, mask, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, keys, values, mask, 1.0), rtol=1e-5, atol=1e-5)


def test_refuses_what_it_cannot_compute():
    q, keys, values = case(1, 2, 1, 1, 8, 24, 24)
    with pytest.raises(RuntimeError, match="shapes"):
        cpu_kv_attention.kv_slots_attention(q, keys, values, torch.ones(1, 1, 1, 8, dtype=torch.bool), 1.0)
    q, keys, values = case(1, 2, 1, 1, 8, 32, 32)
    codes, _, _ = as_codes(keys)
    with pytest.raises(RuntimeError, match="int8 codes take float32 scales"):
        cpu_kv_attention.kv_slots_attention(q, codes, codes, torch.ones(1, 1, 1, 8, dtype=torch.bool), 1.0)
    fp8 = keys.to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="FP8 codes take float32 scales"):
        three = torch.ones(3)  # one KV head here
        cpu_kv_attention.kv_slots_attention(q, fp8, fp8, torch.ones(1, 1, 1, 8, dtype=torch.bool), 1.0, three, three)
    nibbles, half_scales, _ = as_codes(keys, STORED["int4"])
    with pytest.raises(RuntimeError, match="INT4 codes take float16"):
        cpu_kv_attention.kv_slots_attention(q, nibbles, nibbles, torch.ones(1, 1, 1, 8, dtype=torch.bool), 1.0)
    grouped, group_scales = quantize_key_groups(torch.randn(1, 1, 32, 32))
    with pytest.raises(RuntimeError, match="their float recent keys"):
        mask = torch.ones(1, 1, 1, 8, dtype=torch.bool)
        cpu_kv_attention.kv_slots_attention(q, grouped, nibbles, mask, 1.0, group_scales, half_scales)
    assert not cpu_kv_attention.fits(24, 24, torch.float32) and not cpu_kv_attention.fits(64, 64, torch.bfloat16)
    assert cpu_kv_attention.fits(64, 64, torch.float32)
    with pytest.raises(RuntimeError, match="instruction set level 3"):
        cpu_kv_attention.kv_slots_attention(q, keys, values, torch.ones(1, 1, 1, 8, dtype=torch.bool), 1.0, isa=3)


@pytest.mark.parametrize("kv_cache", [None, "int8", "fp8", "int4", "int4-channel"])
def test_the_static_step_reads_the_codes_through_it_and_matches_eager(monkeypatch, kv_cache):
    """A float32 CPU model's static step attends by the op over the cache as stored (int8, FP8 or INT4 codes and
    their scales, KIVI's grouped keys with their float ring, or float32 entries: on AVX-512 hosts too, where it is
    faster than cpu_attention), and gives the growing cache's tokens; once per layer and step, with no dequantized
    copy of the cache beside it. INT4's prompts and
    steps cross groups of 32 keys (40 + 30 tokens)."""
    from lmpress.runtime.generate import generate, static_decode
    from lmpress.runtime.model import Transformer
    from lmpress.weights.kv_quant import KVQuant
    from tests.runtime.conftest import tiny_hf_model

    model = Transformer.from_hf(tiny_hf_model("llama", seed=4))
    schemes = {**STORED, "fp8": STORED["fp8-head"], "int4-channel": KVScheme("int4", "channel")}
    model.kv_quant = None if kv_cache is None else KVQuant(schemes[kv_cache])
    calls = []
    real = cpu_kv_attention.kv_slots_attention

    def spy(q, keys, values, *rest):  # noqa: ANN001, ANN202
        calls.append(keys.dtype)
        return real(q, keys, values, *rest)

    monkeypatch.setattr(cpu_kv_attention, "kv_slots_attention", spy)
    long = kv_cache is not None and kv_cache.startswith("int4")
    prompts = [list(range(3, 43)), list(range(10, 45))] if long else [[5, 6, 7, 8, 9], [3, 4]]
    new = 30 if long else 6
    expected = generate(model, prompts, max_new_tokens=new)
    # the op reads the layer as stored: no step dequantizes the whole cache beside it
    monkeypatch.setattr(StaticSlots, "read", lambda *a: pytest.fail("the static step read the cache dequantized"))
    assert generate(model, prompts, max_new_tokens=new, decode=static_decode()) == expected
    stored = {None: torch.float32, "int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(kv_cache, torch.uint8)
    assert calls == [stored] * (new - 1) * len(model.layers)
