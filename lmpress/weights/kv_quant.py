"""Quantized KV caches: the value types the evaluator, the runtime and the exports share.

A cache entry is a key or value vector of one token and one KV head, ``head_dim`` wide, stored after RoPE (what
attention reads). Two schemes:

- ``int8``: symmetric int8 codes with one float32 scale per token and head, ``s = max|x| / 127``, computed as
  each token is written (dynamic: nothing to calibrate). 64 + 4 bytes per 64-wide vector where float32 takes 256.
- ``int4``: asymmetric 4-bit codes, two a byte, with a float16 step and minimum per token and head,
  ``s = (max - min) / 15`` (QuaRot's KV cache: per token and head after the Hadamard rotation of keys, which
  spreads the outlier channels KIVI quantizes keys per channel for; ``rotate`` in ``KVQuant``). 32 + 4 bytes
  per 64-wide vector. With ``scales: channel`` (int4's default) the keys go KIVI's way instead: per channel over
  groups of ``KEY_GROUP`` tokens (a step and minimum per channel and group), the last unfinished group kept in
  float until it fills; values stay per token. A key's outlier channels (RoPE's low frequencies) then get their
  own range, where per token they stretch every other channel's. 32 + 4 bytes a key per token.
- ``fp8``: E4M3 codes ``cast(x / s)`` under a static scale per layer (``scales: tensor``) or per layer and KV head
  (``scales: head``), calibrated as ``s = max|x| / 448`` over the calibration set: llm-compressor's
  ``kv_cache_scheme`` (static, min/max observer) and the ``k_scale`` / ``v_scale`` vLLM reads. Without calibrated
  scales a cache takes ``s = 1``, vLLM's default for ``kv_cache_dtype=fp8``.

Both round to nearest (E4M3: even on ties, torch's cast), so quantizing a dequantized entry again gives it back:
a gate that fake-quantizes the whole sequence at every call scores what a cache that quantizes each token once
holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lmpress.weights.float8 import FP8_MAX, require_float8

KVDtype = Literal["int8", "int4", "fp8"]
KVScales = Literal["token", "tensor", "head", "channel"]
INT8_MAX = 127.0
INT4_LEVELS = 15.0
KEY_GROUP = 32  # KIVI's G: tokens per group of keys quantized per channel (scales: channel)
SCALES_OF = {"int8": ("token",), "int4": ("channel", "token"), "fp8": ("tensor", "head")}  # the first: default


@dataclass(frozen=True)
class KVScheme:
    """How the cache stores keys and values: ``dtype`` and where its scales live (see the module's docstring)."""

    dtype: KVDtype
    scales: KVScales

    def __post_init__(self) -> None:
        if self.dtype not in SCALES_OF:
            raise ValueError(f"KV cache dtype {self.dtype!r} is not one of {', '.join(SCALES_OF)}")
        if self.scales not in SCALES_OF[self.dtype]:
            raise ValueError(
                f"an {self.dtype} KV cache takes scales {' or '.join(SCALES_OF[self.dtype])}, not {self.scales!r}"
            )

    @property
    def static(self) -> bool:
        """Whether the scales are fixed before the cache sees a token (calibrated), not computed per token."""
        return self.dtype == "fp8"

    @property
    def grouped_keys(self) -> bool:
        """Keys per channel over groups of ``KEY_GROUP`` tokens, the last unfinished group kept float (KIVI)."""
        return self.scales == "channel"

    @property
    def values(self) -> KVScheme:
        """The scheme of the values: per token where the keys go per channel (KIVI), else this one."""
        return KVScheme(self.dtype, "token") if self.grouped_keys else self

    @property
    def code_dtype(self) -> torch.dtype:
        codes = {"int8": torch.int8, "int4": torch.uint8}  # int4: two codes a byte
        return codes[self.dtype] if self.dtype in codes else require_float8("fp8 KV cache")

    def code_width(self, width: int) -> int:
        """Stored codes per vector of ``width`` entries."""
        return width // 2 if self.dtype == "int4" else width

    @property
    def scale_width(self) -> int:
        """Per-token scale entries (int8: the step; int4: step and minimum); 0 for static scales."""
        return {"int8": 1, "int4": 2}.get(self.dtype, 0)

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float16 if self.dtype == "int4" else torch.float32

    def describe(self) -> str:
        if self.grouped_keys:
            return f"{self.dtype.upper()} KV, keys per channel in groups of {KEY_GROUP} tokens, values per token"
        where = "per token and head" if self.scales == "token" else f"static per {self.scales}"
        return f"{self.dtype.upper()} KV, {where}"

    def bytes_per_vector(self, width: int) -> int:
        """Bytes one token's value of one KV head takes: codes, plus its scale where it has its own."""
        scheme = self.values
        return scheme.code_width(width) + scheme.scale_width * torch.empty((), dtype=scheme.scale_dtype).element_size()

    def key_bytes(self, width: int) -> float:
        """Bytes one token's key of one KV head takes; grouped keys share a step and minimum per channel with
        their group (the unfinished group's float keys are a fixed ``KEY_GROUP`` tokens, not counted per token)."""
        if self.grouped_keys:
            return self.code_width(width) + 2 * width * 2 / KEY_GROUP
        return self.bytes_per_vector(width)


def _broadcast(scale: torch.Tensor) -> torch.Tensor:
    """A static scale ``(1,)`` or ``(kv_heads,)`` against entries ``(batch, kv_heads, n, width)``."""
    return scale.float().view(1, -1, 1, 1)


def quantize_kv(
    x: torch.Tensor, scheme: KVScheme, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of entries ``x`` ``(batch, kv_heads, n, width)``.

    int8: codes int8, scales ``(batch, kv_heads, n, 1)`` float32 (a token of zeros takes scale 1).
    int4: codes uint8 ``(batch, kv_heads, n, width / 2)``, two a byte (the even entry low), scales float16
    ``(batch, kv_heads, n, 2)``: step and minimum.
    fp8: codes E4M3 under ``scale`` (``(1,)`` per tensor or ``(kv_heads,)`` per head; None: 1), returned as the
    scales. Grouped keys (``scheme.grouped_keys``) go by ``quantize_key_groups``."""
    if scheme.grouped_keys:
        raise ValueError("keys quantized per channel go by quantize_key_groups (values by scheme.values)")
    x = x.float()
    if scheme.dtype == "int4":
        return _quantize_int4(x)
    if scheme.dtype == "int8":
        s = x.abs().amax(-1, keepdim=True) / INT8_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        return torch.round(x / s).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), s
    scale = torch.ones(1, device=x.device) if scale is None else scale.float().to(x.device)
    return (x / _broadcast(scale)).clamp_(-FP8_MAX, FP8_MAX).to(scheme.code_dtype), scale


def _quantize_int4(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes packed two a byte along the last dimension ``(..., width / 2)`` and float16 ``[step, minimum]`` over
    ``dim`` (stacked along ``dim``); the codes are rounded against the float16 step and minimum that are stored, so
    dequantizing gives what they encode."""
    if x.shape[-1] % 2:
        raise ValueError(f"an int4 KV cache packs two codes a byte: width {x.shape[-1]} is odd")
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    step = ((high - low) / INT4_LEVELS).half().float()
    step = torch.where(step > 0, step, torch.ones_like(step))
    low = low.half().float()
    codes = torch.round((x - low) / step).clamp_(0, INT4_LEVELS).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), torch.cat((step, low), dim).half()


def _dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dim: int = -1) -> torch.Tensor:
    codes = torch.stack((packed & 0x0F, packed >> 4), -1).flatten(-2).float()
    scales = scales.float()
    return codes * scales.narrow(dim, 0, 1) + scales.narrow(dim, 1, 1)


def quantize_key_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``(batch, kv_heads, n, width)``, ``n`` a multiple of ``KEY_GROUP``, as KIVI's cache holds them: int4
    codes per token packed two a byte ``(batch, kv_heads, n, width / 2)`` and float16 ``[step, minimum]`` per
    channel and group of ``KEY_GROUP`` tokens ``(batch, kv_heads, n / KEY_GROUP, 2, width)``."""
    batch, heads, n, width = x.shape
    if n % KEY_GROUP:
        raise ValueError(f"keys quantize in groups of {KEY_GROUP} tokens: {n} tokens is no whole number of groups")
    codes, scales = _quantize_int4(x.float().view(batch, heads, n // KEY_GROUP, KEY_GROUP, width), dim=-2)
    return codes.view(batch, heads, n, width // 2), scales


def dequantize_key_groups(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys from ``quantize_key_groups``'s codes and scales, in ``dtype``."""
    batch, heads, n, half = codes.shape
    grouped = codes.view(batch, heads, n // KEY_GROUP, KEY_GROUP, half)
    return _dequantize_int4(grouped, scales, dim=-2).view(batch, heads, n, 2 * half).to(dtype)


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, scheme: KVScheme, dtype: torch.dtype) -> torch.Tensor:
    """Entries from ``quantize_kv``'s codes and scales, in ``dtype``."""
    if scheme.dtype == "int4":
        return _dequantize_int4(codes, scale).to(dtype)
    s = scale if scheme.scales == "token" else _broadcast(scale)
    return (codes.float() * s).to(dtype)


def fake_quantize_kv(x: torch.Tensor, scheme: KVScheme, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` as the cache gives it back: quantized and dequantized, in ``x``'s dtype."""
    codes, s = quantize_kv(x, scheme, scale)
    return dequantize_kv(codes, s, scheme, x.dtype)


def fake_quantize_keys(x: torch.Tensor, scheme: KVScheme, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Keys ``(batch, kv_heads, n, width)`` of a sequence as the cache gives them back: grouped keys quantized in
    every whole group of ``KEY_GROUP`` tokens, the rest float (KIVI: what a cache holding ``n`` tokens reads)."""
    if not scheme.grouped_keys:
        return fake_quantize_kv(x, scheme, scale)
    whole = x.shape[2] // KEY_GROUP * KEY_GROUP
    if whole == 0:
        return x
    grouped = dequantize_key_groups(*quantize_key_groups(x[:, :, :whole]), x.dtype)
    return torch.cat((grouped, x[:, :, whole:]), 2)


def fake_quantize_values(x: torch.Tensor, scheme: KVScheme, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Values as the cache gives them back (per token where keys go per channel)."""
    return fake_quantize_kv(x, scheme.values, scale)


def fp8_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The static E4M3 scale that maps ``amax`` to 448 (an amax of 0, a layer that saw nothing: scale 1)."""
    scale = amax.float() / FP8_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def cache_bytes_per_token(
    scheme: KVScheme | None, n_layers: int, kv_heads: int, key_width: int, value_width: int, float_bytes: int
) -> float:
    """Bytes a cache holds per token: keys and values of every layer and KV head (``scheme`` None: floats)."""
    if scheme is None:
        return n_layers * kv_heads * (key_width + value_width) * float_bytes
    return n_layers * kv_heads * (scheme.key_bytes(key_width) + scheme.bytes_per_vector(value_width))


@dataclass
class KVQuant:
    """A model's quantized cache: its scheme and, for a static one, each layer's key and value scales (None:
    scale 1 everywhere, as vLLM runs an uncalibrated FP8 cache).

    ``rotate``: queries and keys are turned by the normalized Hadamard matrix of the head's width after RoPE
    (QuaRot's online rotation of attention, its R3 in SpinQuant's naming), so the cache stores ``k @ H``; the
    scores ``(q @ H) · (k @ H)`` are unchanged, while a key's outlier channels spread over every channel, which
    is what a float format's relative rounding of the largest entries costs most (measured: docs)."""

    scheme: KVScheme
    k_scales: list[torch.Tensor] | None = None
    v_scales: list[torch.Tensor] | None = None
    rotate: bool = False

    def scales_of(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.k_scales is None or self.v_scales is None:
            return None, None
        return self.k_scales[layer], self.v_scales[layer]

    def describe(self) -> str:
        calibrated = "" if not self.scheme.static else (", calibrated" if self.k_scales else ", scale 1")
        return self.scheme.describe() + calibrated + (", q/k Hadamard-rotated" if self.rotate else "")


def key_rotation(width: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonal matrix ``KVQuant.rotate`` turns queries and keys by (``x @ H``)."""
    from lmpress.weights.hadamard import hadamard_matrix

    return hadamard_matrix(width).to(device=device, dtype=dtype)
