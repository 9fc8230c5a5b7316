"""A quantized layer as a plain float linear layer: the kernel of last resort, and the float layers' own."""

from __future__ import annotations

import torch
from torch import nn


def dense_linear(layer: nn.Module, dtype: torch.dtype, cls: type[nn.Linear] = nn.Linear) -> nn.Linear:
    """``layer``'s weight dequantized once into a ``cls`` of ``dtype``: full speed, no memory saving."""
    bias = layer.bias
    dense = cls(layer.in_features, layer.out_features, bias=bias is not None, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(layer.dequantized_weight(dtype))
        if bias is not None:
            dense.bias.copy_(bias.detach().float())
    return dense.requires_grad_(False)
