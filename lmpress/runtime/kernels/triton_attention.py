"""Decode attention on a GPU over the filled slots of a fixed-size cache: float entries, int8 codes with a scale per
slot, FP8 E4M3 codes with static scales, or INT4 codes (two a byte) with a float16 step and minimum per slot or, for
KIVI's keys, per channel and group of slots, each read as stored (the CUDA path of the compiled and CUDA-graph
static step; ``attention.slots_attention``).

Split-K ("flash-decoding"): program ``(row and KV head, split)`` reads ``CHUNK`` slots of one KV head once for all
the query rows that share it (grouped-query heads x the step's new tokens, padded to ``tl.dot``'s 16), keeps a
running maximum, sum and weighted values (an online softmax), and writes them; a second kernel merges the splits.
A split that starts past the last filled slot (``pos[-1]``, read on the device) returns before it reads anything,
so a step costs the slots held, not the cache's size, and one launch shape serves every step of a CUDA graph.

Codes are converted in registers (E4M3 from its bits, so GPUs without FP8 types run it too): int8 and E4M3 values
are exact in bfloat16 and float16, so ``q . codes`` is an exact product with float32 sums, and the scales are folded
in afterwards: a key's scale multiplies its score, a value's its softmax weight (per slot) or the result (static).
INT4 codes are exact too: a per-slot step and minimum enter as ``(q . codes) x step + minimum x sum(q)`` for keys
and as each weight times the step plus the weights' sum with the minima for values; KIVI's keys (a step and minimum
per channel and group of ``GROUP`` slots) are dequantized in registers and dotted in float32, the unfinished group
read from the cache's float ring (``grouped_keys``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

CHUNK = 256  # slots per split program
BLOCK_S = 64  # slots per inner step
MIN_ROWS = 16  # tl.dot's smallest tile side: query rows are padded to it
SCALES = {"none": 0, "slot": 1, "head": 2, "tensor": 3, "affine": 4, "groups": 5}


@triton.jit
def _scale_of(ptr, bh, kvh, slots, n_slots, valid, MODE: tl.constexpr):
    """A cache's scale for ``slots`` of (row x KV head) ``bh`` (per slot), for KV head ``kvh`` or for the tensor."""
    if MODE == 1:
        scale = tl.load(ptr + bh.to(tl.int64) * n_slots + slots, mask=valid, other=0.0)
    elif MODE == 2:
        scale = tl.load(ptr + kvh)
    else:
        scale = tl.load(ptr)
    return scale


@triton.jit
def _entries_f32(codes, FP8: tl.constexpr):
    """Loaded entries as float32: floats and int8 codes by conversion, E4M3 codes (loaded as bytes) from their bits,
    so no GPU needs FP8 types (sm_80 has none): sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
    ``m * 2**-9``. Every value is exact; 0x7f / 0xff (NaN) never come out of the cache's quantizer."""
    if FP8:
        bits = codes.to(tl.int32)
        exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
        normal = ((exponent + 120) << 23 | mantissa << 20).to(tl.float32, bitcast=True)
        value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
        return tl.where((bits & 0x80) != 0, -value, value)
    return codes.to(tl.float32)


@triton.jit
def _nibbles_f32(ptr, rows, valid, d, D: tl.constexpr):
    """INT4 entries of the slots ``rows`` (each ``D / 2`` bytes, the even entry in the low bits) as float32."""
    packed = tl.load(ptr + rows[:, None] * (D // 2) + (d // 2)[None, :], mask=valid[:, None], other=0).to(tl.int32)
    return tl.where((d % 2 == 0)[None, :], packed & 0xF, packed >> 4).to(tl.float32)


@triton.jit
def _affine(ptr, rows, valid):
    """INT4 slots' float16 [step, minimum] as two float32 vectors."""
    step = tl.load(ptr + rows * 2, mask=valid, other=0.0).to(tl.float32)
    return step, tl.load(ptr + rows * 2 + 1, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, ring_ptr, mask_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
    n_slots, key_slots, splits, sm_scale,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, N: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
    K_MODE: tl.constexpr, V_MODE: tl.constexpr, FP8: tl.constexpr, DOT_F32: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_S: tl.constexpr, KEY_GROUP: tl.constexpr, RING: tl.constexpr,
):  # fmt: skip
    bh, split = tl.program_id(0), tl.program_id(1)
    limit = tl.load(pos_ptr + N - 1) + 1  # slots filled after this step's writes
    start = split * CHUNK
    if start >= limit:
        return
    b, kvh = bh // KV_HEADS, bh % KV_HEADS
    rows = tl.arange(0, R)  # row r: query head kvh * GROUP + r // N, new token r % N
    live = rows < GROUP * N
    head, token = kvh * GROUP + rows // N, rows % N
    d = tl.arange(0, D)
    q_at = ((b * KV_HEADS * GROUP + head) * N + token).to(tl.int64) * D
    q = tl.load(q_ptr + q_at[:, None] + d[None, :], mask=live[:, None], other=0.0)
    m = tl.full((R,), float("-inf"), tl.float32)
    l = tl.zeros((R,), tl.float32)  # noqa: E741 - the softmax's running sum, as the paper names it
    acc = tl.zeros((R, D), tl.float32)
    base = bh.to(tl.int64) * n_slots
    key_base = bh.to(tl.int64) * key_slots  # KIVI's keys: whole groups of slots, maybe more than the values'
    whole = limit // KEY_GROUP * KEY_GROUP  # KIVI: the slots from here on are the unfinished group's, in the ring
    q_sum = tl.sum(q.to(tl.float32), 1)
    for s0 in range(start, tl.minimum(start + CHUNK, limit), BLOCK_S):
        slots = s0 + tl.arange(0, BLOCK_S)
        valid = slots < limit
        entries = (base + slots)[:, None] * D + d[None, :]
        if K_MODE == 5:  # KIVI: dequantized in registers, dotted in float32
            group_at = ((key_base // KEY_GROUP + slots // KEY_GROUP) * 2)[:, None] * D + d[None, :]
            step = tl.load(ks_ptr + group_at, mask=valid[:, None], other=0.0).to(tl.float32)
            low = tl.load(ks_ptr + group_at + D, mask=valid[:, None], other=0.0).to(tl.float32)
            k = _nibbles_f32(k_ptr, key_base + slots, valid, d, D) * step + low
            ring_at = (bh.to(tl.int64) * RING + slots % RING)[:, None] * D + d[None, :]
            floats = tl.load(ring_ptr + ring_at, mask=(valid & (slots >= whole))[:, None], other=0.0)
            k = tl.where((slots >= whole)[:, None], floats, k)
            scores = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
        else:
            if K_MODE == 4:
                k = _nibbles_f32(k_ptr, base + slots, valid, d, D)
            else:
                k = _entries_f32(tl.load(k_ptr + entries, mask=valid[:, None], other=0), FP8)
            if DOT_F32:
                scores = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k.to(q.dtype)))
        if K_MODE == 4:
            step, low = _affine(ks_ptr, base + slots, valid)
            scores = scores * step[None, :] + q_sum[:, None] * low[None, :]
        elif K_MODE != 0 and K_MODE != 5:
            scores = scores * _scale_of(ks_ptr, bh, kvh, slots, n_slots, valid, K_MODE)
        shown = tl.load(mask_ptr + (b * N + token)[:, None].to(tl.int64) * n_slots + slots[None, :],
                        mask=live[:, None] & valid[None, :], other=0)  # fmt: skip
        scores = tl.where(shown != 0, scores * sm_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        anchor = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing shown yet stays at zero
        p = tl.exp(scores - anchor[:, None])
        alpha = tl.exp(m - anchor)
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        lows = tl.zeros((R,), tl.float32)
        if V_MODE == 1:
            p = p * _scale_of(vs_ptr, bh, kvh, slots, n_slots, valid, V_MODE)[None, :]
        if V_MODE == 4:  # INT4 values: weight x step on the codes, the weights' sum with the minima apart
            step, low = _affine(vs_ptr, base + slots, valid)
            lows = tl.sum(p * low[None, :], 1)
            p = p * step[None, :]
            v = _nibbles_f32(v_ptr, base + slots, valid, d, D)
        else:
            v = _entries_f32(tl.load(v_ptr + entries, mask=valid[:, None], other=0), FP8)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee") + lows[:, None]
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype)) + lows[:, None]
        m = m_new
    if V_MODE == 2 or V_MODE == 3:
        acc = acc * _scale_of(vs_ptr, bh, kvh, rows, n_slots, live, V_MODE)
    at = (bh * splits + split).to(tl.int64) * R + rows
    tl.store(m_ptr + at, m)
    tl.store(l_ptr + at, l)
    tl.store(acc_ptr + at[:, None] * D + d[None, :], acc)


@triton.jit
def _merge_kernel(
    m_ptr, l_ptr, acc_ptr, pos_ptr, out_ptr, splits,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, N: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    used = tl.cdiv(tl.load(pos_ptr + N - 1) + 1, CHUNK)  # the splits that ran
    rows, d = tl.arange(0, R), tl.arange(0, D)
    m = tl.full((R,), float("-inf"), tl.float32)
    l = tl.zeros((R,), tl.float32)  # noqa: E741
    acc = tl.zeros((R, D), tl.float32)
    for split in range(0, used):
        at = (bh * splits + split).to(tl.int64) * R + rows
        m_i, l_i = tl.load(m_ptr + at), tl.load(l_ptr + at)
        acc_i = tl.load(acc_ptr + at[:, None] * D + d[None, :])
        m_new = tl.maximum(m, m_i)
        anchor = tl.where(m_new == float("-inf"), 0.0, m_new)
        old, new = tl.exp(m - anchor), tl.exp(m_i - anchor)
        l = l * old + l_i * new  # noqa: E741
        acc = acc * old[:, None] + acc_i * new[:, None]
        m = m_new
    b, kvh = bh // KV_HEADS, bh % KV_HEADS
    live = rows < GROUP * N
    head, token = kvh * GROUP + rows // N, rows % N
    out_at = ((b * KV_HEADS * GROUP + head) * N + token).to(tl.int64) * D
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + out_at[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def fits(head_dim: int, value_dim: int) -> bool:
    """Whether the kernels take these widths (equal, a power of two from 16 to 256)."""
    return head_dim == value_dim and 16 <= head_dim <= 256 and not head_dim & (head_dim - 1)


def scale_mode(scales: torch.Tensor | None, kv_heads: int) -> str:
    """How a cache's scales lie (``SCALES``): none (float entries), per slot (int8), per KV head or one (FP8),
    float16 [step, minimum] per slot (INT4) or per channel and group of slots (KIVI's INT4 keys)."""
    if scales is None:
        return "none"
    if scales.dim() == 5:
        return "groups"
    if scales.dim() == 4:
        return "affine" if scales.dtype == torch.float16 and scales.shape[-1] == 2 else "slot"
    return "head" if scales.numel() == kv_heads and kv_heads > 1 else "tensor"


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    key_scales: torch.Tensor | None,
    values: torch.Tensor,
    value_scales: torch.Tensor | None,
    mask: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    recent_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Queries ``(batch, heads, n, d)`` over a cache's stored ``keys``/``values`` ``(batch, kv_heads, slots, d)``
    (float, int8 or FP8; scales per slot ``(batch, kv_heads, slots, 1)``, per KV head or one, or None; INT4 codes
    ``(batch, kv_heads, slots, d / 2)`` uint8 with float16 [step, minimum] ``(batch, kv_heads, slots, 2)``, KIVI's
    keys with ``(batch, kv_heads, slots / group, 2, d)`` and the float ring ``recent_keys``) where ``mask``
    ``(batch, 1, n, slots)`` shows them; ``pos`` ``(n,)``: the slots this step wrote, ascending. Returns
    ``(batch, heads, n, d)`` in ``q``'s dtype."""
    batch, heads, n, d = q.shape
    kv_heads, n_slots, key_slots = keys.shape[1], values.shape[2], keys.shape[2]
    value_width = values.shape[-1] * (2 if values.dtype == torch.uint8 else 1)  # INT4: two codes a byte
    if not fits(d, value_width):
        raise ValueError(f"decode_attention: head width {d} / {value_width} (equal powers of two, 16 to 256)")
    group = heads // kv_heads
    rows = max(MIN_ROWS, triton.next_power_of_2(group * n))
    splits = triton.cdiv(n_slots, CHUNK)
    partial = (batch * kv_heads, splits, rows)
    m = torch.empty(partial, dtype=torch.float32, device=q.device)
    l = torch.empty(partial, dtype=torch.float32, device=q.device)  # noqa: E741
    acc = torch.empty((*partial, d), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    fp8 = keys.dtype == torch.float8_e4m3fn
    q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
    if fp8:  # read as bytes (_entries_f32)
        keys, values = keys.view(torch.uint8), values.view(torch.uint8)
    mask = mask.contiguous().view(torch.uint8)
    k_mode, v_mode = (SCALES[scale_mode(s, kv_heads)] for s in (key_scales, value_scales))
    if (k_mode == SCALES["groups"]) != (recent_keys is not None):
        raise ValueError("decode_attention: INT4 keys by groups take their float ring of recent keys, others none")
    ks, vs = (s if s is None or s.dtype == torch.float16 else s.float() for s in (key_scales, value_scales))
    ks = ks.contiguous() if ks is not None else m  # an unread pointer where none
    vs = vs.contiguous() if vs is not None else m
    ring = recent_keys.contiguous().float() if recent_keys is not None else m
    key_group = key_slots // key_scales.shape[2] if k_mode == SCALES["groups"] else 1
    shape = dict(KV_HEADS=kv_heads, GROUP=group, N=n, D=d, R=rows)
    # float32 products where the queries are float32, and in Triton's interpreter, whose tl.dot multiplies
    # bfloat16 bit patterns as integers (3.9; triton.py's GEMM does the same)
    dot_f32 = q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    _split_kernel[(batch * kv_heads, splits)](
        q, keys, values, ks, vs, ring, mask, pos, m, l, acc, n_slots, key_slots, splits, scale, **shape,
        K_MODE=k_mode, V_MODE=v_mode, FP8=fp8, DOT_F32=dot_f32, CHUNK=CHUNK, BLOCK_S=BLOCK_S,
        KEY_GROUP=key_group, RING=ring.shape[2] if recent_keys is not None else 1,
    )  # fmt: skip
    _merge_kernel[(batch * kv_heads,)](m, l, acc, pos, out, splits, **shape, CHUNK=CHUNK)
    return out
