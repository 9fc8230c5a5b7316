"""The Triton decode attention (kernels/triton_attention.py) against a float64 softmax over the dequantized cache,
its reading only the filled slots, and the static step of a Triton build attending through it. Without a GPU the
kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is imported) on CPU tensors.

Error bounds are derived, not tuned: in float32 the sums of ``L`` terms leave a relative rms error near
``sqrt(L) * 2**-24``; in half precision the softmax weights and the output are each rounded once (``u / sqrt(3)``
relative rms, ``u = 2**-8`` for bfloat16 and ``2**-11`` for float16; the interpreter truncates bfloat16, so twice
that), while the int8 and E4M3 codes times half-precision queries are exact products; 3 dB of margin.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lmpress.runtime.kernels.fwht import triton_installed
from lmpress.runtime.kv_cache import static_slots_mask
from lmpress.weights.kv_quant import KVScheme
from tests.runtime.test_cpu_attention import case, reference
from tests.runtime.test_cpu_kv_attention import STORED, as_codes, kivi_case

pytestmark = pytest.mark.skipif(not triton_installed(), reason="triton is not installed (lmpress[dev])")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
MARGIN_DB = 3.0


def sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    noise = (got.double() - want).pow(2).sum()
    return float("inf") if noise == 0 else 10 * math.log10(want.pow(2).sum() / noise)


def bound_db(dtype: torch.dtype, slots: int, width: int) -> float:
    """The least SQNR of a correct kernel: in float32, each output sums ``slots`` weighted values after logits that
    each sum ``width`` products (and dequantize them), and rounding errors of random sign grow as the square root of
    the terms summed, the two sums' adding; the 16-bit dtypes' own rounding of the output dominates theirs."""
    if dtype == torch.float32:
        return -20 * math.log10(math.sqrt(slots + width) * UNIT[dtype]) - MARGIN_DB
    u = UNIT[dtype] * (2 if INTERPRETED and dtype == torch.bfloat16 else 1)
    return -10 * math.log10(2 * u * u / 3) - MARGIN_DB


def attend(q, keys, k_scales, values, v_scales, mask, pos, recent=None):  # noqa: ANN001, ANN201
    from lmpress.runtime.kernels.triton_attention import decode_attention

    on = [None if t is None else t.to(DEVICE) for t in (q, keys, k_scales, values, v_scales, mask, pos)]
    return decode_attention(*on, 0.125, None if recent is None else recent.to(DEVICE)).cpu()


@pytest.mark.long
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "n"), [(9, 3, 1), (9, 3, 3), (8, 1, 4), (2, 2, 2)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("stored", ["float", "int8", "fp8-head", "fp8-tensor", "int4"])
def test_matches_a_float64_softmax_over_the_visible_slots(dtype, heads, kv_heads, n, window, stored):
    """Two rows (the second left padded by 7), grouped query heads (3 to 16 rows a KV head), queries ending at slot
    600 of 700: three splits of 256 slots, the last never read (its slots hold 1e4 that any weight would show)."""
    q, keys, values = case(2, heads, kv_heads, n, 700, 64, 64)
    keys[:, :, 601:] = 1e4
    pos = torch.arange(601 - n, 601)
    mask = static_slots_mask(torch.tensor([0, 7]), pos, 700, window)
    q = q.to(dtype)
    if stored == "float":
        keys, values = keys.to(dtype), values.to(dtype)
        out = attend(q, keys, None, values, None, mask, pos)
        k_read, v_read = keys, values
    else:
        (keys, k_scales, k_read), (values, v_scales, v_read) = (as_codes(x, STORED[stored]) for x in (keys, values))
        out = attend(q, keys, k_scales, values, v_scales, mask, pos)
    assert out.dtype == dtype and out.shape == (2, heads, n, 64)
    assert sqnr_db(out, reference(q, k_read, v_read, mask, 0.125)) >= bound_db(dtype, 601, 64)


@pytest.mark.parametrize("stored", ["float", "int8"])
def test_slots_past_the_last_written_one_are_never_read(stored):
    """A mask that shows every slot: what lies past ``pos[-1]`` (NaN entries, NaN scales) must not count, in a
    split partly filled and in the splits past it."""
    q, keys, values = case(1, 4, 2, 2, 800, 32, 32, seed=3)
    pos = torch.tensor([298, 299])
    shown = torch.ones(1, 1, 2, 800, dtype=torch.bool).tril(298)  # causal among the two new tokens only
    if stored == "float":
        k_scales = v_scales = None
    else:
        (keys, k_scales, _), (values, v_scales, _) = (as_codes(x) for x in (keys, values))
        k_scales[:, :, 300:], v_scales[:, :, 300:] = float("nan"), float("nan")
    clean = attend(q, keys, k_scales, values, v_scales, shown, pos)
    if stored == "float":
        keys, values = keys.clone(), values.clone()
        keys[:, :, 300:], values[:, :, 300:] = float("nan"), float("nan")
    dirty = attend(q, keys, k_scales, values, v_scales, shown, pos)
    assert torch.isfinite(dirty).all()
    assert torch.equal(dirty, clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "last"), [(1, 600), (3, 576), (2, 40)])
def test_int4_keys_by_groups_read_codes_up_to_the_unfinished_group_and_its_floats_from_the_ring(dtype, n, last):
    """KIVI's cache as the static step leaves it (whole groups of 32 slots as codes with a step and minimum per
    channel and group; the unfinished group only in the float ring, its codes and the ring's other entries
    garbage; values per token): the kernel matches float64 attention over what they hold, two rows (the second
    left padded by 7), 9 heads on 3 KV heads."""
    q, (codes, scales, v_codes, v_scales, recent), (read, v_read), pos, mask = kivi_case(n, last)
    end = last + 1
    q = q.to(dtype)
    out = attend(q, codes, scales, v_codes, v_scales, mask, pos, recent.to(dtype))
    assert sqnr_db(out, reference(q, read, v_read, mask, 0.125)) >= bound_db(dtype, end, 64)


def test_one_filled_slot_and_a_split_boundary():
    for filled in (1, 256, 257):
        q, keys, values = case(1, 3, 3, 1, 512, 16, 16, seed=filled)
        pos = torch.tensor([filled - 1])
        mask = static_slots_mask(torch.tensor([0]), pos, 512, None)
        out = attend(q, keys, None, values, None, mask, pos)
        assert sqnr_db(out, reference(q, keys, values, mask, 0.125)) >= bound_db(torch.float32, filled, 16)


def test_refuses_widths_it_cannot_take():
    from lmpress.runtime.kernels import triton_attention

    assert triton_attention.fits(64, 64) and triton_attention.fits(128, 128) and triton_attention.fits(16, 16)
    assert not triton_attention.fits(96, 96) and not triton_attention.fits(192, 128) and not triton_attention.fits(8, 8)
    q, keys, values = case(1, 2, 2, 1, 8, 96, 96)
    with pytest.raises(ValueError, match="head width 96"):
        attend(q, keys, None, values, None, torch.ones(1, 1, 1, 8, dtype=torch.bool), torch.tensor([7]))


@pytest.mark.parametrize("kv_cache", [None, "int8", "fp8", "int4", "int4-channel"])
def test_a_triton_builds_static_step_attends_through_it_and_matches_eager(monkeypatch, kv_cache):
    """A float16 model built for Triton: its static step attends by the kernel over the cache as stored (float16
    entries, int8, FP8 or INT4 codes, KIVI's grouped keys with their float ring), once per layer and step, and
    decodes the growing cache's tokens (INT4: a 30-token prompt, so the steps fill a group of 32 keys)."""
    from lmpress.runtime.generate import generate, static_decode
    from lmpress.runtime.kernels import cuda
    from lmpress.runtime.kv_cache import StaticSlots
    from lmpress.runtime.model import Transformer
    from lmpress.weights.kv_quant import KVQuant
    from tests.runtime.conftest import tiny_hf_model

    hf = tiny_hf_model("llama", seed=4, num_hidden_layers=2)
    model = Transformer.from_hf(hf, dtype=torch.float16, device=DEVICE, kernels="triton")
    assert all(layer.attention.slots_kernel.triton for layer in model.layers)
    schemes = {**STORED, "fp8": STORED["fp8-head"], "int4-channel": KVScheme("int4", "channel")}
    model.kv_quant = None if kv_cache is None else KVQuant(schemes[kv_cache])
    calls = []
    real = cuda.triton_decode_attention

    def spy(q, keys, *rest):  # noqa: ANN001, ANN202
        calls.append(keys.dtype)
        return real(q, keys, *rest)

    monkeypatch.setattr("lmpress.runtime.attention.triton_decode_attention", spy)
    long = kv_cache is not None and kv_cache.startswith("int4")
    prompts = [list(range(3, 33)), list(range(7, 34))] if long else [[5, 6, 7, 8, 9], [3, 4]]
    expected = generate(model, prompts, max_new_tokens=4)
    # the kernel reads the layer as stored: no step dequantizes the whole cache beside it (a CUDA graph would)
    monkeypatch.setattr(StaticSlots, "read", lambda *a: pytest.fail("the static step read the cache dequantized"))
    assert generate(model, prompts, max_new_tokens=4, decode=static_decode()) == expected
    stored = {None: torch.float16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(kv_cache, torch.uint8)
    assert calls == [stored] * 3 * len(model.layers)  # the prefill's first token comes from the growing cache


def test_every_fp8_code_reads_as_torch_casts_it():
    """E4M3 codes are decoded from their bits (no FP8 type on the GPU): every code but the two NaNs, subnormals
    included, gives torch's own float8_e4m3fn value."""
    from tests.runtime.triton_fp8_decode import decode

    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(256, device=DEVICE)
    decode[(1,)](codes, out, N=256)
    want = codes.view(torch.float8_e4m3fn).float()
    real = ~want.isnan()
    assert int(real.sum()) == 254
    assert torch.equal(out[real].cpu(), want[real].cpu())
