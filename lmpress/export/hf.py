"""The modified model as an ordinary Hugging Face checkpoint (dense float weights, safetensors).

Quantized layers (integer ``QuantizedLinear`` and FP4 ``Fp4Linear``) are written as the float weights they
stand for, under the original ``<layer>.weight`` names, so any transformers install loads the result (a layer
whose input lmpress rotates at run time, R4, with that rotation folded back into its weight);
gpt-oss's per-expert linears are fused back into its experts' 3-D tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lmpress.calib.moe import fuse_gpt_oss_state, is_gpt_oss_experts
from lmpress.registry import ExportFormat, register_format
from lmpress.weights.fp4 import Fp4Linear
from lmpress.weights.online_rotation import rotate_weight_input, rotated_inputs
from lmpress.weights.qlinear import QuantizedLinear

# the buffers of the layers written dequantized (QuantizedLinear's and Fp4Linear's), dropped for ``weight``
PACKED_BUFFERS = (
    "qweight",
    "scales",
    "zeros",
    "g_idx",
    "weight_packed",
    "weight_scale",
    "weight_global_scale",
    "input_global_scale",
)


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every QuantizedLinear's and Fp4Linear's packed buffers replaced by its
    dequantized weight."""
    state = model.state_dict()
    for name, module in model.named_modules():
        if not isinstance(module, (QuantizedLinear, Fp4Linear)):
            continue
        prefix = f"{name}." if name else ""
        for buffer in PACKED_BUFFERS:
            state.pop(prefix + buffer, None)
        dtype = module.bias.dtype if module.bias is not None else _float_dtype(model)
        state[prefix + "weight"] = module.dequantized_weight(dtype)
    # R4: a layer that turns its input at run time is written with the turn folded back, W V V = W (transformers
    # runs no online rotation)
    for name, block in rotated_inputs(model):
        key = f"{name}.weight" if name else "weight"
        state[key] = rotate_weight_input(state[key], block)
    # transformers re-fuses other families' per-expert tensors on loading, not gpt-oss's: write its layout
    for name, module in model.named_modules():
        if is_gpt_oss_experts(module):
            fuse_gpt_oss_state(state, f"{name}.", len(module))
    return state


def _float_dtype(model: nn.Module) -> torch.dtype:
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


def export_hf(model: nn.Module, tokenizer, out_dir: Path) -> None:
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # A quantized lm_head no longer equals the embedding: write it untied so loaders keep it.
    untie = tied and isinstance(model.get_output_embeddings(), (QuantizedLinear, Fp4Linear))
    if untie:
        config.tie_word_embeddings = False
    try:
        model.save_pretrained(out_dir, state_dict=dense_state_dict(model), safe_serialization=True)
    finally:
        if untie:
            config.tie_word_embeddings = True
    tokenizer.save_pretrained(out_dir)


register_format(
    ExportFormat(
        name="hf",
        write=export_hf,
    )
)
