"""A quantized KV cache in compressed-tensors' terms: ``kv_cache_scheme`` in the quantization config and each
attention module's ``k_scale`` / ``v_scale``, as llm-compressor writes them and vLLM reads them.

compressed-tensors holds a static cache only: FP8 E4M3 (``type: float``, 8 bits) with ``strategy: tensor``
(``k_scale`` of shape ``(1,)``) or ``attn_head`` (``(kv_heads, 1, 1)``). lmpress's INT8 cache, a scale per token
computed as it is written, has no place there: an export records nothing for it (the serving engine picks its
cache type at run time, as for GGUF and ONNX).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.weights.kv_quant import KVQuant, KVScheme

STRATEGIES = {"tensor": "tensor", "head": "attn_head"}  # lmpress's scales -> compressed-tensors' strategy
SCALE_SUFFIXES = (".k_scale", ".v_scale")


def attention_module_names(model: nn.Module) -> dict[int, str]:
    """Each decoder layer's attention module name, by layer index (transformers' ``layer_idx``)."""
    names = {}
    for name, module in model.named_modules():
        if hasattr(module, "layer_idx") and hasattr(module, "k_proj") and hasattr(module, "v_proj"):
            names[int(module.layer_idx)] = name
    return names


def kv_cache_scheme(kv: KVQuant | None) -> dict[str, Any] | None:
    """compressed-tensors' ``kv_cache_scheme`` (``QuantizationArgs``) of ``kv``; None where it has none."""
    if kv is None or not kv.scheme.static:
        return None
    if kv.rotate:
        raise LmpressInputError(
            "compressed-tensors: the KV cache's scales are of Hadamard-rotated keys (kv_cache.rotate), which "
            "vLLM does not rotate: export without rotate"
        )
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": STRATEGIES[kv.scheme.scales],
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
    }


def kv_scale_tensors(model: nn.Module, kv: KVQuant | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``{attention}.k_scale`` / ``.v_scale`` of every layer, shaped as compressed-tensors initializes them."""
    if kv_cache_scheme(kv) is None:
        return {}
    assert kv is not None
    tensors = {}
    for layer, name in attention_module_names(model).items():
        k_scale, v_scale = kv.scales_of(layer)
        for suffix, scale in zip(SCALE_SUFFIXES, (k_scale, v_scale), strict=True):
            value = torch.ones(1) if scale is None else scale.float()
            shape = (1,) if kv.scheme.scales == "tensor" else (value.numel(), 1, 1)
            tensors[name + suffix] = value.reshape(shape).to(dtype).contiguous()
    return tensors


def read_kv_quant(
    quantization_config: dict[str, Any] | None, tensor: Callable[[str], torch.Tensor], n_layers: int
) -> KVQuant | None:
    """The static cache a compressed-tensors checkpoint records (``tensor(key)`` reads one of its tensors), or
    None; a scheme lmpress cannot run is refused in one line."""
    args = (quantization_config or {}).get("kv_cache_scheme")
    if not args:
        return None
    by_strategy = {v: k for k, v in STRATEGIES.items()}
    if args.get("type") != "float" or args.get("num_bits") != 8 or args.get("strategy") not in by_strategy:
        raise LmpressInputError(
            f"compressed-tensors kv_cache_scheme {args.get('type')}{args.get('num_bits')} "
            f"strategy {args.get('strategy')!r}: lmpress runs FP8 (type float, 8 bits) per tensor or attn_head"
        )
    if args.get("dynamic"):
        raise LmpressInputError("compressed-tensors kv_cache_scheme: dynamic FP8 scales; lmpress reads static ones")
    scheme = KVScheme("fp8", by_strategy[args["strategy"]])  # type: ignore[arg-type]
    k_scales, v_scales = [], []
    for layer in range(n_layers):
        prefix = f"model.layers.{layer}.self_attn"
        for scales, suffix in ((k_scales, ".k_scale"), (v_scales, ".v_scale")):
            value = tensor(prefix + suffix).float().reshape(-1)
            if not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
                raise LmpressInputError(f"{prefix}{suffix}: KV scales must be finite and positive, got {value}")
            scales.append(value)
    return KVQuant(scheme, k_scales, v_scales)
