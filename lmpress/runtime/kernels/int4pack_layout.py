"""tinygemm's tensor-core layout of 4-bit codes, as index arithmetic: packing (what CUDA's
``torch.ops.aten._convert_weight_to_int4pack`` computes) and its inverse, so a W4 layer keeps its codes on the GPU
once, in tinygemm's layout, and a prefill reads them back from it (``TinyGemmLinear``).

The layout, read off ``matrix_to_m16n8k16_Bint4_layout`` in PyTorch's ``aten/src/ATen/native/cuda/int4mm.cu``
(CUDA, not ROCm): the input is ``(N, K / 2)`` nibble pairs (column 2i in the high nibble); the output is
``(N / 8, K / (16 t), 32, t / 2)`` int32 for ``t`` inner k-tiles. Word ``[n_tile, k_outer, lane, j]`` packs the four
pair bytes ``v0..v3`` of row ``8 n_tile + lane // 4`` at byte columns ``b, b + 4, b + 8, b + 12`` with
``b = 8 (t k_outer + 2 j) + lane % 4``: their high nibbles in bits 0-15 (v0 lowest), their low nibbles in bits
16-31. The GPU visit checks ``pack_int4_tensor_core`` against torch's op (``bench/gpu_check.py``), and a module
checks the inverse on its own codes before it lets go of them.
"""

from __future__ import annotations

import torch

N_TILE, K_TILE, LANES = 8, 16, 32


def _byte_indices(n: int, k_half: int, inner_k_tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and byte column, each ``(N / 8, K / (16 t), 32, t / 2, 4)``, of the four pair bytes each word packs."""
    if n % N_TILE or (2 * k_half) % (K_TILE * inner_k_tiles) or inner_k_tiles not in (2, 4, 8):
        raise ValueError(f"no tensor-core layout for {n} x {2 * k_half} codes in {inner_k_tiles} inner k-tiles")
    k_outer = 2 * k_half // (K_TILE * inner_k_tiles)
    shape = (n // N_TILE, k_outer, LANES, inner_k_tiles // 2, 1)
    n_tile = torch.arange(n // N_TILE, device=device).view(-1, 1, 1, 1, 1)
    outer = torch.arange(k_outer, device=device).view(1, -1, 1, 1, 1)
    lane = torch.arange(LANES, device=device).view(1, 1, -1, 1, 1)
    j = torch.arange(inner_k_tiles // 2, device=device).view(1, 1, 1, -1, 1)
    rows = (n_tile * N_TILE + lane // 4).expand(shape)
    base = (outer * inner_k_tiles + 2 * j) * (K_TILE // 2) + lane % 4
    columns = base + torch.tensor([0, 4, 8, 12], device=device).view(1, 1, 1, 1, 4)
    return torch.broadcast_tensors(rows, columns)


def pack_int4_tensor_core(pairs: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """``(N, K / 2)`` uint8 nibble pairs in tinygemm's ``(N / 8, K / (16 t), 32, t / 2)`` int32 layout."""
    rows, columns = _byte_indices(pairs.shape[0], pairs.shape[1], inner_k_tiles, pairs.device)
    v = pairs[rows, columns].to(torch.int64)  # (..., 4): v0..v3
    shifts = torch.arange(4, device=pairs.device) * 4
    high = ((v >> 4) << shifts).sum(-1)  # high nibbles: bits 0-15
    low = ((v & 0xF) << (shifts + 16)).sum(-1)  # low nibbles: bits 16-31
    word = high | low
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the same 32 bits, signed


def unpack_int4_tensor_core(words: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4_tensor_core``: ``(N, K / 2)`` uint8 nibble pairs."""
    n_tiles, k_outer, _, half_tiles = words.shape
    inner_k_tiles = 2 * half_tiles
    n, k_half = n_tiles * N_TILE, k_outer * K_TILE * inner_k_tiles // 2
    rows, columns = _byte_indices(n, k_half, inner_k_tiles, words.device)
    w = words.to(torch.int64).unsqueeze(-1) & 0xFFFFFFFF
    shifts = torch.arange(4, device=words.device) * 4
    v = (((w >> shifts) & 0xF) << 4) | ((w >> (shifts + 16)) & 0xF)
    pairs = torch.empty((n, k_half), dtype=torch.uint8, device=words.device)
    pairs[rows.reshape(-1), columns.reshape(-1)] = v.reshape(-1).to(torch.uint8)
    return pairs
