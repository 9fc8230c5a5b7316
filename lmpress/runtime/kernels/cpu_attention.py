"""Attention of a few queries over the filled slots of a preallocated KV cache, on the CPU (``cpu_attention.cpp``).

The compiled decode step (``Transformer.forward_static``) sees a cache of fixed size; Inductor's attention from
broadcast products reads every slot, masked. ``torch.ops.lmpress_cpu.slots_attention`` reads only the slots each
query's mask shows: a decode of 256 tokens after a 128-token prompt reads 2/3 of the keys and values it would.
AVX-512 only (float32 activations, head dims multiples of 16); elsewhere the step keeps Inductor's attention.
"""

from __future__ import annotations

import functools

import torch

from lmpress.runtime.kernels import cpu_int


@functools.cache
def available() -> bool:
    """Whether the op is built and this CPU runs it (AVX-512 VNNI hosts: ``cpu_int.host_isa() == 2``)."""
    return cpu_int.available() and cpu_int.host_isa() == 2 and hasattr(torch.ops.lmpress_cpu, "slots_attention")


def fits(head_dim: int, value_dim: int, dtype: torch.dtype) -> bool:
    """Whether a layer with these head dims and activations can attend through the op on this host."""
    return dtype == torch.float32 and head_dim % 16 == 0 and value_dim % 16 == 0 and available()


def slots_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Queries ``(batch, heads, n, head_dim)`` over ``keys``/``values`` ``(batch, kv_heads, slots, dim)`` where
    ``mask`` ``(batch, 1, n, slots)`` shows them; float32 ``(batch, heads, n, value_dim)``."""
    return torch.ops.lmpress_cpu.slots_attention(
        q.contiguous(), keys.contiguous(), values.contiguous(), mask.contiguous(), scale
    )
