"""tinygemm's tensor-core layout as index arithmetic, against a line-by-line transcription of the CUDA kernel
that defines it (``matrix_to_m16n8k16_Bint4_layout`` in PyTorch's int4mm.cu), and its inverse."""

from __future__ import annotations

import pytest
import torch

from lmpress.runtime.kernels.int4pack_layout import pack_int4_tensor_core, unpack_int4_tensor_core


def cuda_kernel_transcribed(pairs: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """The kernel's loops as written (one block per (k outer tile, n tile), 32 lanes), in Python."""
    n, k_half = pairs.shape
    k_super = 2 * k_half // (inner_k_tiles * 16)
    out = torch.zeros((n // 8, k_super, 32, inner_k_tiles // 2), dtype=torch.int64)
    for k_outer in range(k_super):
        for n_tile in range(n // 8):
            for t in range(32):
                for inner in range(0, inner_k_tiles, 2):
                    n0 = n_tile * 8 + t // 4
                    k_base0 = (k_outer * inner_k_tiles + inner) * 16 // 2
                    ks = [k_base0 + t % 4, k_base0 + t % 4 + 4]
                    k_base1 = k_base0 + 16 // 2
                    ks += [k_base1 + t % 4, k_base1 + t % 4 + 4]
                    v = [int(pairs[n0, k]) for k in ks]
                    pack = (
                        ((v[3] & 0xF) << 28) | ((v[2] & 0xF) << 24) | ((v[1] & 0xF) << 20) | ((v[0] & 0xF) << 16)
                        | ((v[3] & 0xF0) << 8) | ((v[2] & 0xF0) << 4) | (v[1] & 0xF0) | ((v[0] & 0xF0) >> 4)
                    )  # fmt: skip
                    out[n_tile, k_outer, t, inner // 2] = pack - (1 << 32) if pack >= 1 << 31 else pack
    return out.to(torch.int32)


@pytest.mark.parametrize(("n", "k", "inner_k_tiles"), [(16, 64, 2), (8, 128, 4), (24, 256, 8), (16, 512, 8)])
def test_packing_is_the_kernels_and_unpacking_inverts_it(n, k, inner_k_tiles):
    pairs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(n + k))
    packed = pack_int4_tensor_core(pairs, inner_k_tiles)
    assert packed.dtype == torch.int32 and packed.shape == (n // 8, k // (16 * inner_k_tiles), 32, inner_k_tiles // 2)
    assert torch.equal(packed, cuda_kernel_transcribed(pairs, inner_k_tiles))
    assert torch.equal(unpack_int4_tensor_core(packed), pairs)


def test_shapes_without_a_layout_are_refused():
    with pytest.raises(ValueError, match="no tensor-core layout"):
        pack_int4_tensor_core(torch.zeros(12, 32, dtype=torch.uint8), 2)  # N not a multiple of 8
    with pytest.raises(ValueError, match="no tensor-core layout"):
        pack_int4_tensor_core(torch.zeros(8, 48, dtype=torch.uint8), 8)  # K = 96 not a multiple of 128
