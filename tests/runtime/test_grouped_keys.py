"""The runtime's grouped key cache (KIVI's layout, lmpress.runtime.grouped_keys): every way of writing keys into it
reads back what the evaluator's ``fake_quantize_keys`` gives over the same tokens."""

from __future__ import annotations

import torch

from lmpress.runtime.grouped_keys import (
    RING,
    grouped_length,
    read_grouped_keys_static,
    write_grouped_keys,
    write_grouped_keys_static,
)
from lmpress.weights.kv_quant import KEY_GROUP, KVScheme, fake_quantize_keys

SCHEME = KVScheme("int4", "channel")


def empty(slots: int, width: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    padded = grouped_length(slots)
    codes = torch.zeros(2, 3, padded, width // 2, dtype=torch.uint8)
    scales = torch.ones(2, 3, padded // KEY_GROUP, 2, width, dtype=torch.float16)
    return codes, scales, torch.zeros(2, 3, RING, width)


def keys(n: int) -> torch.Tensor:
    return torch.randn(2, 3, n, 16, generator=torch.Generator().manual_seed(n))


def test_a_prefill_then_single_steps_read_what_the_evaluator_reads_after_each():
    x = keys(100)
    codes, scales, recent = empty(100)
    got = write_grouped_keys(codes, scales, recent, x[:, :, :45], 0)
    assert torch.equal(got, fake_quantize_keys(x[:, :, :45], SCHEME))
    for i in range(45, 100):  # through two group boundaries (64, 96)
        got = write_grouped_keys(codes, scales, recent, x[:, :, i : i + 1], i)
        assert torch.equal(got, fake_quantize_keys(x[:, :, : i + 1], SCHEME)), i


def static_write(cache: tuple, k: torch.Tensor, pos: torch.Tensor, length: int) -> torch.Tensor:
    """The static step's write of ``k`` at ``pos``, then its read of ``length`` slots."""
    write_grouped_keys_static(*cache, k, pos)
    return read_grouped_keys_static(*cache, pos, length, k.dtype)


def test_the_static_step_writes_and_reads_as_the_eager_cache_over_any_fill():
    x = keys(90)
    eager, static = empty(90), empty(90)
    write_grouped_keys(*eager, x[:, :, :20], 0)
    write_grouped_keys(*static, x[:, :, :20], 0)
    start = 20
    for n in (1, 3, 1, 4, 13, 1, 2, 20, 1, 1, 4, 1):  # multi-token reads across boundaries, as speculation makes
        want = write_grouped_keys(*eager, x[:, :, start : start + n], start)
        pos = torch.arange(start, start + n)
        got = static_write(static, x[:, :, start : start + n], pos, 90)
        assert got.shape[2] == 90
        torch.testing.assert_close(got[:, :, : start + n], want, rtol=0, atol=0)
        start += n
    whole = start // KEY_GROUP * KEY_GROUP
    assert torch.equal(eager[0][:, :, :whole], static[0][:, :, :whole])  # codes
    assert torch.equal(eager[1][:, :, : whole // KEY_GROUP], static[1][:, :, : whole // KEY_GROUP])  # scales


def test_a_rollback_into_a_filled_group_reads_its_float_keys_again():
    """Speculative decoding truncates the cache: a group that filled and is reopened reads its float keys, and
    quantizes again when it fills again (with the tokens written then)."""
    x, other = keys(70), keys(71)[:, :, :70]
    codes, scales, recent = empty(70)
    write_grouped_keys(codes, scales, recent, x[:, :, :66], 0)  # groups 0 and 1 whole, 64-65 float
    got = static_write((codes, scales, recent), x[:, :, 60:61], torch.tensor([60]), 70)  # back to 60
    torch.testing.assert_close(got[:, :, :61], fake_quantize_keys(x[:, :, :61], SCHEME), rtol=0, atol=0)
    rewritten = torch.cat((x[:, :, :61], other[:, :, 61:64]), 2)
    got = write_grouped_keys(codes, scales, recent, other[:, :, 61:64], 61)
    assert torch.equal(got, fake_quantize_keys(rewritten, SCHEME))
