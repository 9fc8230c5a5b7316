"""Triton GEMV kernels for decode (up to 8 activation rows) over the layout of ``triton_pack``.

Both kernels cut K into ``SPLIT_K`` slices of blocks, one program per (row tile, slice), so a
layer with few rows still fills the GPU with loads. With a split, each program writes its fp32
partial sums to a workspace and counts itself in a per-row-tile counter; the last to arrive adds
the partials in slice order, writes the output and resets the counter for the next call
(serial split-K: one launch, no atomics on the output, the same bits every call).

``_gemv_row_kernel`` serves one row (a decode step), the hot path: 2D ``[BN, T]`` tiles of words
(one block per row), the activation a 1D vector broadcast over the rows, so nothing changes
layout through shared memory inside the loop. The zero point folds into the constant that turns
a masked code into a float: ``(2**23 + q*w) - (2**23 + z*w) = (q - z)*w``, exact in fp32, so the
core of each code is one LOP3, one FADD and one FFMA (5.3-6.5 instructions per code in all on
sm_90, bench/triton_sass.py), and the block's scale multiplies once per word.
``_gemv_kernel`` serves 2-8 rows (a speculative round's verification) with 4D tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lmpress.runtime.kernels.triton_pack import (
    _code_weight,
    _code_weight_inverse,
    _codes_magic_f32,
    _load_block_qparams,
    _scaled_codes_f32,
)


@triton.jit
def _slice_of_blocks(G, SPLIT_K: tl.constexpr):
    """The blocks ``[first, last)`` of K that program ``(n, k)`` streams: the k-th of ``SPLIT_K`` equal slices."""
    per_split = tl.cdiv(G, SPLIT_K)
    first = tl.program_id(1) * per_split
    return first, tl.minimum(first + per_split, G)


@triton.jit
def _write_output(
    y, y_ptrs, part_ptrs, part_stride, count_ptr, bias, mask, pid_n, pid_k, SPLIT_K: tl.constexpr
):  # fmt: skip
    """Store ``y + bias`` (no split), or this slice's partial sums and, from the last slice to arrive, their sum."""
    if SPLIT_K > 1:
        tl.store(part_ptrs + pid_k * part_stride, y, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter is raised (release below)
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros(y.shape, dtype=tl.float32)
            for s in range(SPLIT_K):  # ".cg": read the other programs' partials from L2, never a stale L1 line
                total += tl.load(part_ptrs + s * part_stride, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, (total + bias).to(y_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)
    else:
        tl.store(y_ptrs, (y + bias).to(y_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_row_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, KW, G, stride_xm, stride_ym,
    BITS: tl.constexpr, C: tl.constexpr, ZERO: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """``y[0] = x[0] @ W.T``: program ``(n, k)`` streams BN rows over slice k, NB blocks per iteration."""
    T: tl.constexpr = C * BITS // 32
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_r = tl.arange(0, T)
    mask_n = offs_n < N
    b_first, b_last = _slice_of_blocks(G, SPLIT_K)
    acc = tl.zeros((BN, T), dtype=tl.float32)
    for b0 in range(b_first, b_last, NB):
        for i in tl.static_range(NB):
            b = b0 + i
            live_rows = mask_n & (offs_n * 0 + b < b_last)  # rows of a block inside this slice
            live_cols = offs_r * 0 + b < b_last
            words = tl.load(w_ptr + offs_n[:, None] * KW + b * T + offs_r[None, :], mask=live_rows[:, None], other=0)
            high = words >> 16
            # Scale and zero loaded as [BN, T] tiles (stride 0 along T), already in the words' layout: a [BN]
            # load would cross shared memory to get there, two barriers per block (bench/triton_sass.py).
            qparams = offs_n[:, None] * G + b + offs_r[None, :] * 0
            scale = tl.load(s_ptr + qparams, mask=live_rows[:, None], other=0.0).to(tl.float32)
            if ZERO >= 0:
                zero = tl.full((BN, 1), ZERO, tl.float32)
            else:
                zero = tl.load(z_ptr + qparams, mask=live_rows[:, None], other=0).to(tl.float32)
            dot = tl.zeros((BN, T), dtype=tl.float32)
            for k in tl.static_range(16 // BITS):  # codes k and k + H of a word share their weight w
                magic = 8388608.0 + zero * _code_weight(k, BITS)  # 2**23 + z * w: the float of code z
                for half in tl.static_range(2):
                    j = half * (16 // BITS) + k
                    col = b * C + j * T + offs_r  # code j of word r is column j * T + r of the block
                    mask_x = (col < K) & live_cols
                    if HAS_PERM:
                        col = tl.load(perm_ptr + col, mask=mask_x, other=0)
                    xj = tl.load(x_ptr + col, mask=mask_x, other=0.0).to(tl.float32) * _code_weight_inverse(j, BITS)
                    dot += (_codes_magic_f32(words, high, j, BITS) - magic) * xj[None, :]
            acc += scale * dot
    y = tl.sum(acc, axis=1)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    _write_output(y, y_ptr + offs_n, part_ptr + offs_n, N, count_ptr, bias, mask_n, pid_n, pid_k, SPLIT_K)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, KW, G, stride_xm, stride_ym,
    BITS: tl.constexpr, C: tl.constexpr, ZERO: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """``y[:M] = x[:M] @ W.T`` for M <= BM: program ``(n, k)`` streams BN rows over slice k, NB blocks at once."""
    PER: tl.constexpr = 32 // BITS
    T: tl.constexpr = C // PER
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_r = tl.arange(0, T)
    mask_m = offs_m < M
    mask_n = offs_n < N
    b_first, b_last = _slice_of_blocks(G, SPLIT_K)
    acc = tl.zeros((BM, BN, NB, T), dtype=tl.float32)
    for b0 in range(b_first, b_last, NB):
        offs_b = b0 + tl.arange(0, NB)
        mask_b = offs_b < b_last
        word_idx = offs_b[:, None] * T + offs_r[None, :]  # [NB, T]
        mask_w = mask_n[:, None, None] & mask_b[None, :, None]
        words = tl.load(w_ptr + offs_n[:, None, None] * KW + word_idx[None, :, :], mask=mask_w, other=0)
        high = words >> 16
        scale, zero = _load_block_qparams(s_ptr, z_ptr, offs_n, offs_b, mask_n[:, None] & mask_b[None, :], G, ZERO)
        dot = tl.zeros((BM, BN, NB, T), dtype=tl.float32)
        xsum = tl.zeros((BM, 1, NB, T), dtype=tl.float32)
        for j in tl.static_range(PER):
            col = offs_b[:, None] * C + j * T + offs_r[None, :]  # [NB, T], contiguous along T
            mask_x = mask_m[:, None, None] & ((col < K) & mask_b[:, None])[None, :, :]
            if HAS_PERM:
                col = tl.load(perm_ptr + col, mask=(col < K) & mask_b[:, None], other=0)
            xj = tl.load(x_ptr + offs_m[:, None, None] * stride_xm + col[None, :, :], mask=mask_x, other=0.0)
            xj = xj.to(tl.float32)[:, None, :, :]
            xsum += xj
            # _scaled_codes_f32 weighs code j by 2**(BITS * (j % H)): undo it on the activation.
            dot += (xj * _code_weight_inverse(j, BITS)) * _scaled_codes_f32(words, high, j, BITS)[None, :, :, :]
        # sum_j (q_j - z) s x_j = s * (sum_j q_j x_j - z * sum_j x_j), per block
        acc += scale[None, :, :, None] * (dot - zero[None, :, :, None] * xsum)
    y = tl.sum(tl.sum(acc, axis=3), axis=2)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    mask_y = mask_m[:, None] & mask_n[None, :]
    part_ptrs = part_ptr + offs_m[:, None] * N + offs_n[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    _write_output(y, y_ptrs, part_ptrs, BM * N, count_ptr, bias, mask_y, pid_n, pid_k, SPLIT_K)
