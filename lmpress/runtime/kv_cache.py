"""A KV cache preallocated for the maximum length, shared by every layer of one model.

Rows of a batch are left padded to one prompt length, so every row writes the same
slot at every step; ``pad[b]`` says how many of row ``b``'s first slots are padding.
A token's position (for RoPE) is its slot minus its row's padding, and a key slot is
visible to a query when it is not padding, not in the query's future and, for a
sliding-window layer, not more than ``window - 1`` slots behind it.

A quantized cache (``kv``, ``lmpress.weights.kv_quant``) holds codes: each token is quantized once, as it is
written (grouped keys once their group fills: ``grouped_keys``), and attention reads the filled slots dequantized
to the model's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lmpress.runtime.grouped_keys import (
    RING,
    grouped_length,
    read_grouped_keys_static,
    write_grouped_keys,
    write_grouped_keys_static,
)
from lmpress.weights.kv_quant import KEY_GROUP, KVQuant, KVScheme, dequantize_kv, quantize_kv


class KVCache:
    """Keys and values, one ``(batch, kv_heads, max_len, head_dim)`` tensor per layer, filled up to ``length``
    (values ``v_head_dim`` wide where given).

    Each layer's tensors are allocated on their own, not as views of one big tensor: a compiled
    decode step that writes into a view would have to rebuild (copy) the whole base tensor at
    every layer, while a write into a tensor of its own stays in place.
    """

    def __init__(
        self,
        n_layers: int,
        batch: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        pad: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        v_head_dim: int | None = None,
        kv: KVQuant | None = None,
        rotation: torch.Tensor | None = None,
    ) -> None:
        widths = (head_dim, v_head_dim or head_dim)  # narrower values: DeepSeek's
        grouped = kv is not None and kv.scheme.grouped_keys
        if kv is not None:
            widths = tuple(kv.scheme.code_width(w) for w in widths)
        key_len = grouped_length(max_len) if grouped else max_len
        shape, v_shape = (batch, n_kv_heads, key_len, widths[0]), (batch, n_kv_heads, max_len, widths[1])
        stored = dtype if kv is None else kv.scheme.code_dtype
        self.k = [torch.zeros(shape, dtype=stored, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(v_shape, dtype=stored, device=device) for _ in range(n_layers)]
        self.kv, self.dtype, self.rotation = kv, dtype, rotation  # rotation: queries and keys turned first
        self.k_scales, self.v_scales = _scales(kv, n_layers, batch, n_kv_heads, max_len, device, head_dim)
        ring = (batch, n_kv_heads, RING, head_dim)  # grouped keys: the float keys of the last slots
        self.k_recent = [torch.zeros(ring, dtype=dtype, device=device) for _ in range(n_layers)] if grouped else []
        pad = torch.zeros(batch, dtype=torch.long) if pad is None else pad.to(torch.long)
        self.pad = pad.to(device)
        self.max_len = max_len
        self.length = 0
        self.has_padding = bool(pad.any())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v + self.k_scales + self.v_scales + self.k_recent)

    @property
    def side(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """A quantized cache's tensors beside the codes, per layer: key and value scales, grouped keys' float ring."""
        return self.k_scales, self.v_scales, self.k_recent

    @property
    def bytes_per_token(self) -> float:
        """What one more token costs the cache: every layer's key and value, scales included."""
        return self.nbytes / (self.max_len * self.batch)

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def positions(self, n_new: int) -> torch.Tensor:
        """RoPE positions ``(batch, n_new)`` of the next ``n_new`` slots."""
        slots = torch.arange(self.length, self.length + n_new, device=self.pad.device)
        return (slots[None, :] - self.pad[:, None]).clamp(min=0)

    def attention_mask(self, n_new: int, window: int | None = None) -> torch.Tensor | None:
        """Boolean ``(batch, 1, n_new, length + n_new)`` mask for the next ``n_new`` queries (None: all visible)."""
        total = self.length + n_new
        if n_new == 1 and not self.has_padding and (window is None or total <= window):
            return None
        query = torch.arange(self.length, total, device=self.pad.device)[:, None]
        key = torch.arange(total, device=self.pad.device)[None, :]
        visible = (key <= query) & (key[None] >= self.pad[:, None, None])
        if window is not None:
            visible = visible & (query - key < window)
        # A padding query sees only itself: a row of all-masked keys would make SDPA return NaN,
        # and NaN keys/values leak into real rows even where masked (0 * NaN).
        visible = visible | (key == query)
        return visible[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` ``(batch, kv_heads, n_new, head_dim)`` after ``length``; the filled slots (views, or
        for a quantized cache, the filled slots dequantized)."""
        end = self.length + k.shape[2]
        if self.kv is None:
            self.k[layer][:, :, self.length : end] = k
            self.v[layer][:, :, self.length : end] = v
            return self.k[layer][:, :, :end], self.v[layer][:, :, :end]
        filled = slice(self.length, end)
        scheme = self.kv.scheme
        if scheme.grouped_keys:
            keys = write_grouped_keys(self.k[layer], self.k_scales[layer], self.k_recent[layer], k, self.length)
        else:
            keys = _write(self.k[layer], self.k_scales[layer], k, scheme, filled)
        return keys, _write(self.v[layer], self.v_scales[layer], v, scheme.values, filled)

    def advance(self, n_new: int) -> None:
        """Mark ``n_new`` more slots as filled (after every layer has written them)."""
        self.length += n_new

    def truncate(self, length: int) -> None:
        """Forget every slot from ``length`` on (speculative rollback); nothing is reallocated."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0


def _scales(
    kv: KVQuant | None,
    n_layers: int,
    batch: int,
    kv_heads: int,
    max_len: int,
    device: torch.device | str,
    key_width: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's key and value scales: one per slot and head (dynamic; grouped keys: per channel and group of
    slots), the static ones, or none (float)."""
    if kv is None:
        return [], []
    scheme = kv.scheme
    if not scheme.static:
        shape = (batch, kv_heads, max_len, scheme.scale_width)
        key_shape = (batch, kv_heads, grouped_length(max_len) // KEY_GROUP, 2, key_width)
        return [
            torch.ones(key_shape if scheme.grouped_keys else shape, dtype=scheme.scale_dtype, device=device)
            for _ in range(n_layers)
        ], [torch.ones(shape, dtype=scheme.scale_dtype, device=device) for _ in range(n_layers)]
    ones = [torch.ones(1, device=device) for _ in range(n_layers)]
    k_scales = kv.k_scales or ones
    v_scales = kv.v_scales or ones
    return [s.float().to(device) for s in k_scales], [s.float().to(device) for s in v_scales]


def _write(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, scheme: KVScheme, slots: slice) -> torch.Tensor:
    """Quantize ``x`` into ``slots`` of one layer's ``codes`` (and its per-token ``scales``); the filled slots read
    back in ``x``'s dtype."""
    new_codes, new_scales = quantize_kv(x, scheme, scales if scheme.static else None)
    codes[:, :, slots] = new_codes
    if not scheme.static:
        scales[:, :, slots] = new_scales
    read = scales if scheme.static else scales[:, :, : slots.stop]
    return dequantize_kv(codes[:, :, : slots.stop], read, scheme, x.dtype)


class StoredLayer(NamedTuple):
    """A layer's cache as stored (``StaticSlots.stored``)."""

    keys: torch.Tensor
    key_scales: torch.Tensor | None
    values: torch.Tensor
    value_scales: torch.Tensor | None
    recent_keys: torch.Tensor | None = None  # INT4 keys by groups: the float keys of the last slots (``RING``)


class StaticSlots:
    """A compiled step's view of a ``KVCache``: it writes the new tokens' slots ``pos`` and reads every slot.

    Nothing here depends on how full the cache is (``pos`` is a tensor, the mask
    hides the empty slots), so one compiled graph, or one CUDA graph, serves every step.
    A quantized cache's codes (and scales) are written the same way and read dequantized.
    """

    def __init__(
        self,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        pos: torch.Tensor,
        side: tuple[list[torch.Tensor], ...] = ([], [], []),
        kv: KVQuant | None = None,
        rotation: torch.Tensor | None = None,
    ) -> None:
        self.k, self.v, self.pos = k, v, pos
        self.k_scales, self.v_scales, self.k_recent = (*side, [], [], [])[:3]  # KVCache.side
        self.kv, self.rotation = kv, rotation

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's keys and values (quantized where the cache is) at slots ``pos``."""
        if self.kv is None:
            self.k[layer].index_copy_(2, self.pos, k)
            self.v[layer].index_copy_(2, self.pos, v)
            return
        scheme = self.kv.scheme
        if scheme.grouped_keys:
            write_grouped_keys_static(self.k[layer], self.k_scales[layer], self.k_recent[layer], k, self.pos)
        else:
            self._write(self.k[layer], self.k_scales[layer], k, scheme)
        self._write(self.v[layer], self.v_scales[layer], v, scheme.values)

    def read(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's keys and values in ``dtype``, dequantized: for the attention that cannot read them as
        stored (``stored``). A step that attends by an op over the stored layer never calls this, so neither its
        compiled graph nor its CUDA graph dequantizes the whole cache."""
        if self.kv is None:
            return self.k[layer], self.v[layer]
        scheme = self.kv.scheme
        if scheme.grouped_keys:
            slots = self.v[layer].shape[2]  # grouped keys take whole groups of slots, maybe more
            args = (self.k[layer], self.k_scales[layer], self.k_recent[layer], self.pos, slots, dtype)
            keys = read_grouped_keys_static(*args)
        else:
            keys = dequantize_kv(self.k[layer], self.k_scales[layer], scheme, dtype)
        return keys, dequantize_kv(self.v[layer], self.v_scales[layer], scheme.values, dtype)

    def stored(self, layer: int) -> StoredLayer:
        """One layer's keys and values as stored, for an attention op that reads them: float entries in the model's
        dtype (no scales), int8 codes with a float32 scale per slot, FP8 codes with their static float32 scales
        (per KV head, or one), or INT4 codes (uint8, two a byte) with float16 [step, minimum] per slot, and for keys
        by groups (KIVI) per channel and group of slots with the float ring of the last keys."""
        if self.kv is None:
            return StoredLayer(self.k[layer], None, self.v[layer], None)
        recent = self.k_recent[layer] if self.kv.scheme.grouped_keys else None
        return StoredLayer(self.k[layer], self.k_scales[layer], self.v[layer], self.v_scales[layer], recent)

    def _write(self, codes: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, scheme: KVScheme) -> None:
        new_codes, new_scale = quantize_kv(x, scheme, scale if scheme.static else None)
        if codes.dtype == torch.int8 or codes.dtype == torch.uint8:
            codes.index_copy_(2, self.pos, new_codes)  # in place: a write through a view would copy the whole cache
        else:  # float8 has no index_copy_
            codes.view(torch.uint8).index_copy_(2, self.pos, new_codes.view(torch.uint8))
        if not scheme.static:
            scale.index_copy_(2, self.pos, new_scale.to(scale.dtype))


def static_slots_mask(pad: torch.Tensor, pos: torch.Tensor, max_len: int, window: int | None) -> torch.Tensor:
    """Boolean ``(batch, 1, n, max_len)``: the slots each query at slots ``pos`` ``(n,)`` sees (filled up to its
    own, not padding, in window)."""
    slot = torch.arange(max_len, device=pad.device)
    visible = (slot <= pos[:, None])[None] & (slot >= pad[:, None])[:, None]
    if window is not None:
        visible = visible & (pos[:, None] - slot < window)[None]
    return visible[:, None]
