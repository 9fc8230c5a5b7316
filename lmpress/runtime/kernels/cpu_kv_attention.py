"""Attention of a few queries over a cache of float32 entries, int8, FP8 or INT4 codes, on any AVX2 or AVX-512 CPU
(``cpu_kv_attention.cpp``, its vector body ``cpu_kv_rows.h``).

The compiled decode step's attention where the head width fits: the op reads int8 codes with their per-slot scales
(a quarter of a float32 cache's bytes) or FP8 E4M3 codes with their static scales as stored, converting each code
once in registers for every query row of its KV head's group, and float32 caches faster than AVX-512's
``cpu_attention`` does. The work is split over chunks of slots, so every KV head's entries are read once per step.
On a 2-vCPU Xeon at 4,096 slots: 101-106 us per SmolLM2 layer over int8 codes, 157 over FP8, 273-280 over float32;
decode at 4,000 tokens of context 1.54-1.72x faster with an INT8 cache (docs/methods/kv-cache.md).
"""

from __future__ import annotations

import functools

import torch

from lmpress.runtime.kernels import cpu_int


@functools.cache
def available() -> bool:
    """Whether the op is built and this CPU runs it (AVX2 + FMA)."""
    return cpu_int.available() and cpu_int.host_isa() >= 1 and hasattr(torch.ops.lmpress_cpu, "kv_slots_attention")


def fits(head_dim: int, value_dim: int, dtype: torch.dtype) -> bool:
    """Whether a layer with these head dims and activations can attend through the op on this host."""
    return dtype == torch.float32 and head_dim == value_dim and head_dim in (16, 32, 48, 64, 96, 128) and available()


def kv_slots_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
    isa: int = -1,
    recent_keys: torch.Tensor | None = None,
    pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Queries ``(batch, heads, n, head_dim)`` float32 over ``keys``/``values`` ``(batch, kv_heads, slots, dim)``
    where ``mask`` ``(batch, 1, n, slots)`` shows them; float32 ``(batch, heads, n, dim)``. The entries: float32;
    int8 codes with float32 ``key_scales``/``value_scales`` ``(batch, kv_heads, slots, 1)``; FP8 codes with static
    float32 scales ``(kv_heads)`` or ``(1)``; INT4 codes ``(batch, kv_heads, slots, dim / 2)`` uint8 with float16
    ``[step, minimum]`` ``(batch, kv_heads, slots, 2)`` (``kv_quant.quantize_kv``); INT4 keys by groups (KIVI,
    ``grouped_keys``) with ``key_scales`` ``(batch, kv_heads, slots / group, 2, dim)``, the float ring
    ``recent_keys`` and the step's slots ``pos``. ``isa``: 2 AVX-512, 1 AVX2, -1 the best this CPU runs."""
    return torch.ops.lmpress_cpu.kv_slots_attention(
        q.contiguous(), keys.contiguous(), key_scales, values.contiguous(), value_scales, mask.contiguous(), scale, isa,
        recent_keys, pos,
    )  # fmt: skip
