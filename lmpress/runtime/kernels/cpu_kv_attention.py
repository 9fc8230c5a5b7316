"""Attention of a few queries over a cache of float32 entries or int8 codes, on any AVX2 CPU
(``cpu_kv_attention.cpp``).

The compiled decode step's attention where ``cpu_attention``'s AVX-512 op does not run (AVX2 hosts, such as many
AMD EPYCs) or where the cache holds int8 codes: the op reads the codes and their per-slot scales, a quarter of the
bytes a float32 cache takes, and dequantizes each chunk of slots once into a float32 scratch its query rows share.
The work is split over chunks of slots, so every KV head's entries are read once per step. Measured on an AVX2
EPYC (docs/methods/kv-cache.md), the int8 read is no faster than the float32 one: the conversion costs what the
bytes save.
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
) -> torch.Tensor:
    """Queries ``(batch, heads, n, head_dim)`` float32 over ``keys``/``values`` ``(batch, kv_heads, slots, dim)``
    (float32, or int8 codes with float32 ``key_scales``/``value_scales`` ``(batch, kv_heads, slots, 1)``) where
    ``mask`` ``(batch, 1, n, slots)`` shows them; float32 ``(batch, heads, n, dim)``. ``isa``: 2 AVX-512, 1 AVX2,
    -1 the best this CPU runs."""
    return torch.ops.lmpress_cpu.kv_slots_attention(
        q.contiguous(), keys.contiguous(), key_scales, values.contiguous(), value_scales, mask.contiguous(), scale, isa
    )
