"""GGML block layouts: packed bytes against the gguf package's own quantizer and dequantizer."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from lmpress.export.ggml_blocks import Q4_K_BYTES, pack_q4_0, pack_q4_k, unpack_q4_0, unpack_q4_k


def test_pack_q4_0_matches_gguf_layout():
    """pack_q4_0 against gguf's own Q4_0 quantizer on values that sit exactly on a Q4_0 grid."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (8, 64), generator=gen, dtype=torch.uint8)
    codes[:, ::32] = 0  # each block's most negative value -8*d: gguf picks d = max / -8 = d exactly
    scales = torch.rand(8, 2, generator=gen).half()
    weights = (codes.float() - 8) * scales.float().repeat_interleave(32, dim=1)
    theirs = gguf.quants.quantize(weights.numpy(), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(pack_q4_0(codes, scales), theirs)
    back_codes, back_scales = unpack_q4_0(theirs, 64)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)


def random_q4_k(rows: int, cols: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    d, dmin = (torch.rand(rows, cols // 256, generator=gen).half() for _ in range(2))
    sc, m = (torch.randint(0, 64, (rows, cols // 256, 8), generator=gen, dtype=torch.uint8) for _ in range(2))
    return codes, d, dmin, sc, m


def test_pack_q4_k_round_trips_and_dequantizes_as_gguf_reads_it():
    codes, d, dmin, sc, m = random_q4_k(5, 768)
    blocks = pack_q4_k(codes, d, dmin, sc, m)
    assert blocks.dtype == np.uint8 and blocks.shape == (5, 3 * Q4_K_BYTES) and Q4_K_BYTES == 144
    for got, want in zip(unpack_q4_k(blocks, 768), (codes, d, dmin, sc, m), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    theirs = dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(5, 768)
    per_group = (d.float()[..., None] * sc.float()).reshape(5, 24).repeat_interleave(32, dim=1)
    offset = (dmin.float()[..., None] * m.float()).reshape(5, 24).repeat_interleave(32, dim=1)
    assert np.array_equal(theirs, (per_group * codes.float() - offset).numpy())
