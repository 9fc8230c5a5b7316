"""llama.cpp's k-quant scales for W4 g32 symmetric weights: group scales on a 6-bit grid per 256 columns.

A GGML ``Q4_K`` block covers 256 columns of a row as 8 groups of 32 and dequantizes
``w = d * sc_j * q - dmin * m_j`` (``d``, ``dmin`` float16; ``sc_j``, ``m_j`` 6-bit integers;
``q`` in 0..15). lmpress's symmetric W4 codes dequantize ``w = s_j * (q - 8)``: that is the same
form when every group scale of the super-block is ``s_j = d * sc_j`` (then ``dmin = 8 * d`` and
``m_j = sc_j``). With ``k_quant_scales`` a quantizer puts its scales there, quantizing the group
scales themselves against one float16 super-scale per 256 columns (the double quantization of
llama.cpp's k-quants):

    d   = max_j s_j / 63, rounded up to 5 significant bits (and to a multiple of 2**-24)
    s_j = d * clamp(round(s_j / d), 1, 63)

With ``d`` on 5 significant bits, ``d * sc`` needs at most 11, float16's precision, so the
float16 scales every checkpoint format stores are exactly these products, and a GGUF ``Q4_K``
file dequantizes to lmpress's weights bit for bit. ``kquant_grid`` recovers ``(d, sc)`` from
stored scales alone, so a checkpoint read back (GPTQ, compressed-tensors) that carries no flag
is still recognised.
"""

from __future__ import annotations

import torch

SUPER_BLOCK = 256  # columns per Q4_K block (GGML's QK_K)
GROUP = 32  # columns per group, the Q4_K sub-block
GROUPS_PER_SUPER_BLOCK = SUPER_BLOCK // GROUP
SCALE_MAX = 63  # 6-bit scale indices
D_BITS = 5  # significant bits of d: 5 + 6 bits of sc fit float16's 11
FP16_QUANTUM = 2.0**-24  # float16's smallest subnormal: every float16 is an integer multiple of it
FP16_MAX = 65504.0


def super_scale(scales: torch.Tensor) -> torch.Tensor:
    """``d`` of each super-block from its group scales ``(..., 8)``; groups holding only zeros count as 0.

    ``max / 63`` rounded up to 5 significant bits, so the largest group keeps (about) its range
    and ``d * sc`` is a float16 for every ``sc`` in 0..63. A super-block of zeros gets the ``d``
    of scale 1 (``compute_qparams``'s scale for an all-zero group).
    """
    top = scales.float().amax(dim=-1) / SCALE_MAX
    top = torch.where(top > 0, top, torch.full_like(top, 1.0 / SCALE_MAX))
    _, exponent = torch.frexp(top)  # top = m * 2**exponent with 0.5 <= m < 1
    quantum = torch.ldexp(torch.ones_like(top), exponent - D_BITS).clamp(min=FP16_QUANTUM)
    return torch.ceil(top / quantum) * quantum


def snap_scales(scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``d * clamp(round(scales / d), 1, 63)``; ``d`` broadcasts against ``scales``. Exact in float32."""
    return torch.round(scales.float() / d).clamp(1, SCALE_MAX) * d


def snap_to_kquant_grid(scales: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Group scales ``(rows, n_groups)`` (groups of 32 in column order) on the k-quant grid.

    ``live`` (bool, same shape) marks groups holding a nonzero weight: only those set ``d``.
    """
    rows, n_groups = scales.shape
    if n_groups % GROUPS_PER_SUPER_BLOCK:
        raise ValueError(f"{n_groups} groups of {GROUP} do not fill {SUPER_BLOCK}-column super-blocks")
    blocks = scales.float().reshape(rows, -1, GROUPS_PER_SUPER_BLOCK)
    alive = live.reshape(blocks.shape)
    d = super_scale(torch.where(alive, blocks, torch.zeros_like(blocks)))
    return snap_scales(blocks, d[..., None]).reshape(rows, n_groups)


def live_groups(grouped: torch.Tensor) -> torch.Tensor:
    """Which groups of ``grouped`` ``(..., width)`` hold a nonzero weight."""
    return grouped.abs().amax(dim=-1) > 0


def kquant_grid(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(d, sc)`` with ``d * sc == scales`` exactly, or None when the scales are off every k-quant grid.

    ``scales``: float16 ``(rows, n_groups)`` (groups of 32, ``n_groups`` a multiple of 8).
    Returns float16 ``d`` ``(rows, n_groups/8)`` and uint8 ``sc`` ``(rows, n_groups/8, 8)`` in 0..63.
    Every float16 is an integer multiple of 2**-24, so ``d`` is the greatest common divisor of a
    super-block's scales in those units: any ``d`` that works divides it, so its ``sc`` are the
    smallest possible, and if they exceed 63 no ``d`` works. ``8 * d`` (Q4_K's ``dmin``) must be a
    float16 too.
    """
    rows, n_groups = scales.shape
    if n_groups % GROUPS_PER_SUPER_BLOCK or scales.dtype != torch.float16 or bool((scales < 0).any()):
        return None
    if not bool(torch.isfinite(scales).all()):
        return None
    units = (scales.double() / FP16_QUANTUM).round().long().reshape(rows, -1, GROUPS_PER_SUPER_BLOCK)
    gcd = units[..., 0]
    for j in range(1, GROUPS_PER_SUPER_BLOCK):
        gcd = torch.gcd(gcd, units[..., j])
    gcd = torch.where(gcd > 0, gcd, torch.ones_like(gcd))  # a super-block of zero scales: d = 2**-24, sc = 0
    sc = units // gcd[..., None]
    if bool((sc > SCALE_MAX).any()):
        return None
    d = gcd.double() * FP16_QUANTUM
    if bool((8 * d > FP16_MAX).any()):
        return None
    d = d.to(torch.float16)
    sc = sc.to(torch.uint8)
    if not torch.equal(d.float()[..., None] * sc.float(), scales.float().reshape(sc.shape)):
        return None
    return d, sc
