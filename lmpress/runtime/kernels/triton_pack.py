"""The Triton kernels' weight layout: packing once at load, and the jit helpers that read codes back.

Weight layout (``prepare_w4a16`` / ``prepare_w8a16``, once at load). The input axis is cut
into blocks of ``C`` columns (the group width; per-channel weights use ``C = 128`` with the
row's scale repeated and K zero-padded), so every block has one scale and zero per row.
A block's codes live in ``T = C * bits / 32`` int32 words per row, and *within a block* the
packing is interleaved: nibble (or byte) ``j`` of word ``r`` holds column ``j * T + r``.
Unpacking nibble ``j`` of a ``[rows, T]`` word tile then yields ``T`` *consecutive* columns,
so the matching activations are one contiguous vector load (the "shift over a tiled
layout" used by gemlite and by FasterTransformer-style GEMV kernels) instead of a stride-8
gather. Words are stored ``(N, K / (32 / bits))``, row-major: a GEMV program streams whole
rows, and the GEMM kernel reorders a tile back to column order in registers.

Act-order (``g_idx``) is handled by sorting the input columns by group
(``perm = argsort(g_idx)``, as lmpress's CPU path does) so groups are contiguous; the
kernels gather the activation columns through ``perm``. Every group must then hold
exactly ``group_size`` columns (true of GPTQ's act-order).

Dequantization: ``w = (q - zero) * scale`` with fp16 scales (fp32 where fp16 would
overflow or lose them) and uint8 zeros, or one compile-time zero when all zeros agree
(symmetric schemes), which saves a load per block. Codes become floats through the
exponent trick (``q | 0x4B000000`` read as fp32 is ``2**23 + q``), avoiding the
quarter-rate integer-to-float conversion; masking a code in place instead of shifting it
(``_scaled_codes_f32``) saves the shift. Accumulation is fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lmpress.weights.qlinear import QuantizedLinear, trivial_g_idx
from lmpress.weights.scheme import QuantizedWeight

PER_CHANNEL_BLOCK = 128
FP16_MIN_NORMAL = 2.0**-14
FP16_MAX = 65504.0


@dataclass
class PackedWeight:
    """A quantized linear layer in the kernels' layout (see the module docstring)."""

    bits: int
    in_features: int
    out_features: int
    block: int  # C: columns per block, one scale/zero per row and block
    words: torch.Tensor  # (N, K_pad * bits / 32) int32, interleaved within blocks
    scales: torch.Tensor  # (N, K_pad / C) float16 or float32
    zeros: torch.Tensor | None  # (N, K_pad / C) uint8, or None when every zero equals `zero`
    zero: int
    perm: torch.Tensor | None  # (K,) int32 source column of each sorted column (act-order)
    bias: torch.Tensor | None

    @property
    def codes_per_word(self) -> int:
        return 32 // self.bits

    @property
    def n_blocks(self) -> int:
        return self.scales.shape[1]

    def nbytes(self) -> int:
        """Bytes a matmul reads for the weight: codes, scales and zeros."""
        zeros = 0 if self.zeros is None else self.zeros.numel()
        return self.words.numel() * 4 + self.scales.numel() * self.scales.element_size() + zeros


# Packing ----------------------------------------------------------------------------------


def _unpacked(source: QuantizedLinear | QuantizedWeight) -> tuple[QuantizedWeight, torch.Tensor | None]:
    if isinstance(source, QuantizedLinear):
        return source.unpack(), source.bias
    if isinstance(source, QuantizedWeight):
        return source, None
    raise TypeError(f"expected a QuantizedLinear or QuantizedWeight, got {type(source).__name__}")


def _act_order_perm(qw: QuantizedWeight, block: int) -> torch.Tensor | None:
    in_features = qw.qweight.shape[1]
    if trivial_g_idx(qw.g_idx, in_features, qw.scheme):
        return None
    g_idx = qw.g_idx.long()
    counts = torch.bincount(g_idx, minlength=qw.scales.shape[1])
    if not bool((counts == block).all()):
        raise ValueError(f"act-order needs every group to hold exactly {block} columns, got counts {counts.tolist()}")
    return torch.argsort(g_idx, stable=True)


def _interleave_blocks(codes: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """``(N, K_pad)`` codes -> ``(N, K_pad * bits / 32)`` int32 words, interleaved within each block."""
    per = 32 // bits
    n, k_pad = codes.shape
    t = block // per
    # (N, blocks, j, r) -> (N, blocks, r, j): word r of a block gathers columns j * T + r.
    grouped = codes.to(torch.int64).reshape(n, k_pad // block, per, t).transpose(2, 3)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int64) * bits
    words = (grouped << shifts).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).reshape(n, -1).contiguous()


def _scale_tensor(scales: torch.Tensor) -> torch.Tensor:
    """fp16 when every scale is a normal fp16 number (GPTQ checkpoints store them so), else fp32."""
    s = scales.float().abs()
    if bool(((s >= FP16_MIN_NORMAL) & (s <= FP16_MAX)).all()):
        return scales.to(torch.float16).contiguous()
    return scales.float().contiguous()


def _prepare(source: QuantizedLinear | QuantizedWeight, bits: int) -> PackedWeight:
    qw, bias = _unpacked(source)
    if qw.scheme.bits != bits:
        raise ValueError(f"expected a {bits}-bit weight, got {qw.scheme.describe()}")
    out_features, in_features = qw.qweight.shape
    per_channel = qw.scales.shape[1] == 1 and qw.scheme.group_size in (-1, in_features)
    block = PER_CHANNEL_BLOCK if per_channel else qw.scheme.group_width(in_features)
    if block % (32 // bits) or block & (block - 1):
        raise ValueError(f"group width {block} must be a power of two holding whole int32 words")
    perm = _act_order_perm(qw, block)
    codes, scales, zeros = qw.qweight, qw.scales, qw.zeros
    if perm is not None:
        codes = codes[:, perm]
    k_pad = -(-in_features // block) * block
    codes = torch.nn.functional.pad(codes.to(torch.int32), (0, k_pad - in_features))
    if per_channel:
        scales, zeros = scales.expand(-1, k_pad // block), zeros.expand(-1, k_pad // block)
    zeros = zeros.round().to(torch.uint8)
    uniform = zeros.numel() > 0 and bool((zeros == zeros.flatten()[0]).all())
    return PackedWeight(
        bits=bits,
        in_features=in_features,
        out_features=out_features,
        block=block,
        words=_interleave_blocks(codes, block, bits),
        scales=_scale_tensor(scales),
        zeros=None if uniform else zeros.contiguous(),
        zero=int(zeros.flatten()[0]) if uniform else -1,
        perm=None if perm is None else perm.to(torch.int32),
        bias=None if bias is None else bias.detach().clone(),
    )


def prepare_w4a16(source: QuantizedLinear | QuantizedWeight) -> PackedWeight:
    """Repack a 4-bit layer (or unpacked weight) for ``w4a16_matmul``; bias is kept for a QuantizedLinear."""
    return _prepare(source, 4)


def prepare_w8a16(source: QuantizedLinear | QuantizedWeight) -> PackedWeight:
    """Repack an 8-bit layer (or unpacked weight) for ``w8a16_matmul``."""
    return _prepare(source, 8)


# Reading codes in kernels ---------------------------------------------------------------


@triton.jit
def _scaled_codes_f32(words, high, j: tl.constexpr, BITS: tl.constexpr):
    """Code ``j`` times ``2**(BITS * (j % H))`` as fp32, ``H = 16 / BITS`` codes per half word, one LOP3 each.

    Masking in place (no shift) keeps the code's weight ``2**(BITS * (j % H))``, at most ``2**12``,
    so ``2**23 + q * 2**(BITS * (j % H))`` is still exact; the caller scales the activation by the
    inverse. ``high`` is ``words >> 16``, shifted once per word for the upper half.
    """
    return _codes_magic_f32(words, high, j, BITS) - 8388608.0


@triton.jit
def _codes_magic_f32(words, high, j: tl.constexpr, BITS: tl.constexpr):
    """``2**23 + q_j * 2**(BITS * (j % H))`` as fp32 (see ``_scaled_codes_f32``), before subtracting ``2**23``."""
    H: tl.constexpr = 16 // BITS
    if j < H:
        part = words & (((1 << BITS) - 1) << (j * BITS))
    else:
        part = high & (((1 << BITS) - 1) << ((j - H) * BITS))
    return (part | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _code_weight(j: tl.constexpr, BITS: tl.constexpr):
    """``2**(BITS * (j % H))``: the weight ``_scaled_codes_f32`` leaves on code ``j``."""
    return 1 << (BITS * (j % (16 // BITS)))


@triton.jit
def _code_weight_inverse(j: tl.constexpr, BITS: tl.constexpr):
    """``2**-(BITS * (j % H))``: undoes the weight ``_scaled_codes_f32`` leaves on code ``j``."""
    return 1.0 / (1 << (BITS * (j % (16 // BITS))))


@triton.jit
def _load_block_qparams(s_ptr, z_ptr, offs_n, offs_b, mask, G, ZERO: tl.constexpr):
    """Scale and zero of rows ``offs_n`` and blocks ``offs_b`` as fp32 ``[BN, NB]``."""
    ptrs = offs_n[:, None] * G + offs_b[None, :]
    scale = tl.load(s_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    if ZERO >= 0:
        zero = tl.full(scale.shape, ZERO, tl.float32)
    else:
        zero = tl.load(z_ptr + ptrs, mask=mask, other=0).to(tl.float32)
    return scale, zero
