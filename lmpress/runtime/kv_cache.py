"""A KV cache preallocated for the maximum length, shared by every layer of one model.

Rows of a batch are left padded to one prompt length, so every row writes the same
slot at every step; ``pad[b]`` says how many of row ``b``'s first slots are padding.
A token's position (for RoPE) is its slot minus its row's padding, and a key slot is
visible to a query when it is not padding, not in the query's future and, for a
sliding-window layer, not more than ``window - 1`` slots behind it.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values, one ``(batch, kv_heads, max_len, head_dim)`` tensor per layer, filled up to ``length``.

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
    ) -> None:
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        pad = torch.zeros(batch, dtype=torch.long) if pad is None else pad.to(torch.long)
        self.pad = pad.to(device)
        self.max_len = max_len
        self.length = 0
        self.has_padding = bool(pad.any())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

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
        """Write ``k``/``v`` ``(batch, kv_heads, n_new, head_dim)`` after ``length``; the filled views."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

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


class StaticSlots:
    """A compiled step's view of a ``KVCache``: it writes the new tokens' slots ``pos`` and reads every slot.

    Nothing here depends on how full the cache is (``pos`` is a tensor, the mask
    hides the empty slots), so one compiled graph, or one CUDA graph, serves every step.
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], pos: torch.Tensor) -> None:
        self.k, self.v, self.pos = k, v, pos

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k[layer].index_copy_(2, self.pos, k)
        self.v[layer].index_copy_(2, self.pos, v)
        return self.k[layer], self.v[layer]


def static_slots_mask(pad: torch.Tensor, pos: torch.Tensor, max_len: int, window: int | None) -> torch.Tensor:
    """Boolean ``(batch, 1, n, max_len)``: the slots each query at slots ``pos`` ``(n,)`` sees (filled up to its
    own, not padding, in window)."""
    slot = torch.arange(max_len, device=pad.device)
    visible = (slot <= pos[:, None])[None] & (slot >= pad[:, None])[:, None]
    if window is not None:
        visible = visible & (pos[:, None] - slot < window)[None]
    return visible[:, None]
