"""A transformers model with a quantized KV cache, for the evaluator, and the calibration of static KV scales.

The evaluator scores a transformers model. Its attention modules hand their kernel the keys (after RoPE) and
values of the whole sequence so far; ``kv_quantized`` puts a kernel of lmpress's in front of the model's own
that passes them through ``fake_quantize_keys`` / ``fake_quantize_values`` first, with each layer's scales. That
is exactly what lmpress's runtime reads back from a quantized cache (``lmpress.runtime.kv_cache``: each token
quantized once as it is written, grouped keys once their group fills; quantizing a dequantized entry again gives
it back), so a gate scores the cache the runtime runs.

``calibrate_kv_scales`` runs the calibration samples through the model with an observing kernel in front and
takes FP8's static scales from each layer's largest |key| and |value| (per tensor or per KV head), as
llm-compressor's min/max observer for its ``kv_cache_scheme``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

import torch
from pydantic import model_validator
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.progress import QUIET, Bars
from lmpress.registry import StrictConfig
from lmpress.weights.kv_quant import (
    SCALES_OF,
    KVQuant,
    KVScheme,
    fake_quantize_keys,
    fake_quantize_values,
    fp8_scale_from_amax,
    key_rotation,
)


class KVCacheConfig(StrictConfig):
    """The recipe's ``kv_cache:`` section: how the evaluated and served model's KV cache is quantized.

    Sample (with or without weight stages; FP8's scales are calibrated on the recipe's ``data``):

        kv_cache: {dtype: fp8, scales: tensor}   # E4M3, one static scale per layer (vLLM's k_scale / v_scale)
        kv_cache: {dtype: fp8, scales: head}     # one per layer and KV head
        kv_cache: {dtype: int8}                  # int8, a scale per token and head, computed as it is written
        kv_cache: {dtype: fp8, rotate: true}     # queries and keys Hadamard-rotated first (lmpress's runtime)
        kv_cache: {dtype: int4}                  # 4-bit: keys per channel in groups of 32 tokens, values per token
                                                 # (KIVI), a step and minimum each
        kv_cache: {dtype: int4, scales: token, rotate: true}  # keys per token too, Hadamard-rotated (QuaRot)
    """

    dtype: Literal["fp8", "int8", "int4"]
    scales: Literal["tensor", "head", "token", "channel"] | None = None  # default: fp8 tensor, int8 token, int4 channel
    rotate: bool = False  # KVQuant.rotate: served by lmpress's runtime; vLLM has no such online rotation

    @model_validator(mode="after")
    def _scales_fit(self) -> KVCacheConfig:
        if self.scales is not None and self.scales not in SCALES_OF[self.dtype]:
            raise ValueError(
                f"an {self.dtype} KV cache takes scales {' or '.join(SCALES_OF[self.dtype])}, not {self.scales!r}"
            )
        return self

    def scheme(self) -> KVScheme:
        return KVScheme(self.dtype, self.scales or SCALES_OF[self.dtype][0])


QUANTIZED_KV_ATTENTION = "lmpress_quantized_kv"
OBSERVED_KV_ATTENTION = "lmpress_observed_kv"
_KV = "_lmpress_kv_quant"  # on an attention config: the KVQuant its kernel applies
_INNER = "_lmpress_kv_inner"  # on an attention config: the kernel lmpress's runs in front of
_SEEN = "_lmpress_kv_seen"  # on an attention config, while calibrating: {layer: [key amax, value amax]}
_ROTATE = "_lmpress_kv_rotate"  # on an attention config, while calibrating: keys observed Hadamard-rotated


def rotate_queries_and_keys(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q @ H, k @ H)`` (``KVQuant.rotate``): the same scores, a key's outlier channels spread over all."""
    if query.shape[-1] != key.shape[-1]:
        raise LmpressInputError(
            f"kv_cache.rotate: queries {query.shape[-1]} wide and keys {key.shape[-1]} wide cannot share a rotation"
        )
    h = key_rotation(key.shape[-1], key.device, key.dtype)
    return query @ h, key @ h


def attention_configs(model: nn.Module) -> list[Any]:
    """The configs of ``model``'s attention modules (one per text model; modules with a ``layer_idx``)."""
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(module, "layer_idx") and config is not None and hasattr(config, "_attn_implementation"):
            configs[id(config)] = config
    if not configs:
        raise LmpressInputError(
            f"{type(model).__name__}: no transformers attention modules found (a module with layer_idx and a "
            "config): its KV cache cannot be quantized by lmpress"
        )
    return list(configs.values())


def inner_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    """The attention kernel a kernel put in front (``kernel_in_front``) replaced (``sdpa``, ``eager``...), called
    as ``module``'s forward would call it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(module.config, _INNER)
    if name in ALL_ATTENTION_FUNCTIONS:
        inner = ALL_ATTENTION_FUNCTIONS[name]
    else:
        inner = sys.modules[type(module).__module__].eager_attention_forward
    return inner(module, query, key, value, *args, **kwargs)


def quantized_kv_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    """The model's own attention kernel over keys and values as the quantized cache holds them."""
    config = module.config
    kv: KVQuant = getattr(config, _KV)
    if kv.rotate:
        query, key = rotate_queries_and_keys(query, key)
    k_scale, v_scale = kv.scales_of(module.layer_idx)
    key = fake_quantize_keys(key, kv.scheme, k_scale)
    value = fake_quantize_values(value, kv.scheme, v_scale)
    return inner_attention(module, query, key, value, *args, **kwargs)


def observed_kv_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    """The model's own attention kernel, recording the largest |key| and |value| per KV head on the way."""
    config = module.config
    if getattr(config, _ROTATE):
        query, key = rotate_queries_and_keys(query, key)
    seen = getattr(config, _SEEN)
    k_amax, v_amax = key.detach().abs().float().amax((0, 2, 3)), value.detach().abs().float().amax((0, 2, 3))
    if not (torch.isfinite(k_amax).all() and torch.isfinite(v_amax).all()):
        raise LmpressInputError(
            f"KV cache calibration: layer {module.layer_idx}'s keys or values hold NaN or inf on the calibration "
            "data: the model produces non-finite attention inputs"
        )
    before = seen.get(module.layer_idx)
    if before is not None:
        k_amax, v_amax = before[0].maximum(k_amax), before[1].maximum(v_amax)
    seen[module.layer_idx] = [k_amax, v_amax]
    return inner_attention(module, query, key, value, *args, **kwargs)


@contextmanager
def kernel_in_front(model: nn.Module, name: str, kernel: Callable, **attributes: Any) -> Iterator[list[Any]]:
    """``kernel`` registered as attention kernel ``name`` and run by every attention module of ``model`` while the
    block lasts, ``attributes`` set on their configs; it reaches the kernel it replaced with ``inner_attention``.
    Yields the configs."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, kernel)
    configs = attention_configs(model)
    before = [config._attn_implementation for config in configs]
    for config, inner in zip(configs, before, strict=True):
        setattr(config, _INNER, inner)
        for key, value in attributes.items():
            setattr(config, key, value)
        config._attn_implementation = name
    try:
        yield configs
    finally:
        for config, inner in zip(configs, before, strict=True):
            config._attn_implementation = inner
            for key in (_INNER, *attributes):
                if hasattr(config, key):
                    delattr(config, key)


@contextmanager
def kv_quantized(model: nn.Module, kv: KVQuant | None) -> Iterator[nn.Module]:
    """``model`` running attention over a ``kv``-quantized cache (nothing changes where ``kv`` is None); a
    runtime view of it (``Transformer.sharing``) makes caches quantized the same way."""
    if kv is None:
        yield model
        return
    with kernel_in_front(model, QUANTIZED_KV_ATTENTION, quantized_kv_attention, **{_KV: kv}), _recorded(model, kv):
        yield model


def float_cache(model: nn.Module) -> AbstractContextManager[nn.Module]:
    """``model`` with no quantized cache recorded on it, for as long as the block lasts (a read-back export carries
    its scheme: runtime views of it would quantize their caches); its own attention reads floats already."""
    return _recorded(model, None)


@contextmanager
def _recorded(model: nn.Module, kv: KVQuant | None) -> Iterator[nn.Module]:
    """``kv`` recorded on ``model`` (``attach_kv_quant``) while the block lasts, what it had restored after."""
    before = kv_quant_of(model)
    attach_kv_quant(model, kv)
    try:
        yield model
    finally:
        attach_kv_quant(model, before)


def attach_kv_quant(model: nn.Module, kv: KVQuant | None) -> None:
    """Record on ``model`` the quantized cache it is served with (exports and runtime views read it); its own
    attention is left as it is (``kv_quantized`` changes that)."""
    if kv is None:
        if hasattr(model, _KV):
            delattr(model, _KV)
    else:
        setattr(model, _KV, kv)


def kv_quant_of(model: nn.Module) -> KVQuant | None:
    """The quantized cache recorded on ``model`` (``attach_kv_quant``, ``kv_quantized``), if any."""
    return getattr(model, _KV, None)


def kv_cache_report(kv: KVQuant, model: nn.Module) -> dict[str, Any]:
    """The report's ``kv_cache`` entry: the scheme, and bytes per token against the model's float cache."""
    from lmpress.weights.kv_quant import cache_bytes_per_token

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers, kv_heads = config.num_hidden_layers, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    float_bytes = next(model.parameters()).element_size()
    quantized = cache_bytes_per_token(kv.scheme, layers, kv_heads, head_dim, head_dim, float_bytes)
    floats = cache_bytes_per_token(None, layers, kv_heads, head_dim, head_dim, float_bytes)
    bf16 = cache_bytes_per_token(None, layers, kv_heads, head_dim, head_dim, 2)
    report: dict[str, Any] = {
        "scheme": kv.describe(),
        "bytes_per_token": quantized,
        "float_bytes_per_token": floats,
        "ratio_to_bf16": quantized / bf16,
    }
    if kv.k_scales is not None and kv.v_scales is not None:
        report["k_scale_range"] = [float(min(s.min() for s in kv.k_scales)), float(max(s.max() for s in kv.k_scales))]
        report["v_scale_range"] = [float(min(s.min() for s in kv.v_scales)), float(max(s.max() for s in kv.v_scales))]
    return report


@torch.no_grad()
def calibrate_kv_scales(
    model: nn.Module,
    samples: torch.Tensor,
    scheme: KVScheme,
    bars: Bars = QUIET,
    batch_size: int = 8,
    rotate: bool = False,
) -> KVQuant:
    """FP8's static scales of every layer from the calibration ``samples`` ``(n, seq_len)`` (of the rotated keys
    with ``rotate``); a dynamic scheme (int8, per token) needs none and returns as it is."""
    if not scheme.static:
        return KVQuant(scheme, rotate=rotate)
    if samples.numel() == 0:
        raise LmpressInputError("KV cache calibration: the calibration set holds no tokens")
    device = next(model.parameters()).device
    observing = {_SEEN: {}, _ROTATE: rotate}
    with kernel_in_front(model, OBSERVED_KV_ATTENTION, observed_kv_attention, **observing) as configs:
        starts = range(0, len(samples), batch_size)
        for start in bars.track(starts, "KV cache scales", total=len(starts)):
            model(input_ids=samples[start : start + batch_size].to(device), use_cache=False)
        seen: dict[int, list[torch.Tensor]] = {}
        for config in configs:
            seen.update(getattr(config, _SEEN))
    if not seen:
        raise LmpressInputError("KV cache calibration: no attention layer saw a token")
    layers = range(max(seen) + 1)
    missing = [i for i in layers if i not in seen]
    if missing:
        raise LmpressInputError(f"KV cache calibration: attention layers {missing} saw no token")

    def scale(amax: torch.Tensor) -> torch.Tensor:
        return fp8_scale_from_amax(amax.amax().reshape(1) if scheme.scales == "tensor" else amax).cpu()

    return KVQuant(scheme, [scale(seen[i][0]) for i in layers], [scale(seen[i][1]) for i in layers], rotate)
