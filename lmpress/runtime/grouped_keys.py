"""Keys quantized per channel over groups of ``KEY_GROUP`` tokens in lmpress's cache (KIVI; ``scales: channel``).

A group's step and minimum per channel need all of its tokens, so the cache keeps the float keys of the last
``RING`` slots (slot ``s`` at ``s % RING``) and quantizes a group when its last token is written. Attention reads
every whole group dequantized and the unfinished group's keys in float: what ``fake_quantize_keys`` gives the
evaluator over the same tokens. Two groups' worth of slots keep the group that filled last while the next one
fills, so a step that completes a group finds all of its tokens, and a speculative rollback (fewer than
``KEY_GROUP`` tokens) finds the float keys of the group it reopens.
"""

from __future__ import annotations

import torch

from lmpress.weights.kv_quant import KEY_GROUP, dequantize_key_groups, quantize_key_groups

RING = 2 * KEY_GROUP


def grouped_length(max_len: int) -> int:
    """Slots a grouped key cache allocates for ``max_len`` tokens: whole groups."""
    return -(-max_len // KEY_GROUP) * KEY_GROUP


def write_grouped_keys(
    codes: torch.Tensor, scales: torch.Tensor, recent: torch.Tensor, k: torch.Tensor, start: int
) -> torch.Tensor:
    """Write keys ``k`` ``(batch, kv_heads, n, width)`` at slots ``[start, start + n)`` of one layer: ``codes``
    ``(batch, kv_heads, slots, width / 2)``, ``scales`` ``(batch, kv_heads, slots / KEY_GROUP, 2, width)``, the
    float ``recent`` ring ``(batch, kv_heads, RING, width)``. Returns the keys of slots ``[0, start + n)`` as
    attention reads them, in ``k``'s dtype."""
    end = start + k.shape[2]
    first = start // KEY_GROUP * KEY_GROUP  # the unfinished group's first slot
    earlier = recent[:, :, torch.arange(first, start, device=k.device) % RING]
    span = torch.cat((earlier.to(k.dtype), k), 2)  # float keys of slots [first, end)
    whole = end // KEY_GROUP * KEY_GROUP
    if whole > first:
        new_codes, new_scales = quantize_key_groups(span[:, :, : whole - first])
        codes[:, :, first:whole] = new_codes
        scales[:, :, first // KEY_GROUP : whole // KEY_GROUP] = new_scales.to(scales.dtype)
    kept = max(first, end - RING)
    recent[:, :, torch.arange(kept, end, device=k.device) % RING] = span[:, :, kept - first :].to(recent.dtype)
    quantized = dequantize_key_groups(codes[:, :, :whole], scales[:, :, : whole // KEY_GROUP], k.dtype)
    return torch.cat((quantized, span[:, :, whole - first :]), 2)


def write_grouped_keys_static(
    codes: torch.Tensor, scales: torch.Tensor, recent: torch.Tensor, k: torch.Tensor, pos: torch.Tensor
) -> None:
    """``write_grouped_keys`` for the compiled static step: keys ``k`` at the consecutive slots ``pos`` ``(n,)``,
    with no branch on how full the cache is (the last whole group is quantized again from the ring, and kept
    only where this step finished it)."""
    if k.shape[2] > KEY_GROUP:
        raise ValueError(f"a static step writes at most {KEY_GROUP} keys into a grouped key cache, not {k.shape[2]}")
    recent.index_copy_(2, pos % RING, k.to(recent.dtype))
    whole = (pos[-1] + 1) // KEY_GROUP * KEY_GROUP
    group = (whole // KEY_GROUP - 1).clamp(min=0).view(1)  # the last whole group
    filled_now = whole > pos[0]  # its last slot is written in this step (never for whole == 0: pos[0] >= 0)
    slots = group * KEY_GROUP + torch.arange(KEY_GROUP, device=pos.device)
    new_codes, new_scales = quantize_key_groups(recent.index_select(2, slots % RING))
    codes.index_copy_(2, slots, torch.where(filled_now, new_codes, codes.index_select(2, slots)))
    scales.index_copy_(2, group, torch.where(filled_now, new_scales.to(scales.dtype), scales.index_select(2, group)))


def read_grouped_keys_static(
    codes: torch.Tensor, scales: torch.Tensor, recent: torch.Tensor, pos: torch.Tensor, length: int, dtype: torch.dtype
) -> torch.Tensor:
    """The keys of all ``length`` slots of a grouped key cache last written at slots ``pos``, in ``dtype``: whole
    groups dequantized, the unfinished one from the ring (the slots after ``pos`` hold anything: the step's mask
    hides them)."""
    end = pos[-1] + 1
    whole = end // KEY_GROUP * KEY_GROUP
    slot = torch.arange(codes.shape[2], device=pos.device)
    unfinished = ((slot >= whole) & (slot < end))[:, None]
    floats = recent.index_select(2, slot % RING).to(dtype)
    return torch.where(unfinished, floats, dequantize_key_groups(codes, scales, dtype))[:, :, :length]
