"""A quantized layer as a plain float linear layer: the kernel of last resort, and the float layers' own."""

from __future__ import annotations

import torch
from torch import nn


def linear_over(cls: type[nn.Linear], weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A ``cls`` whose weight and bias are these tensors (a Parameter is kept as it is: tied weights stay one).
    Built on the meta device: a constructed layer would fill a weight only to drop it (0.3 s for a 49k-row head)."""
    layer = cls(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype, device="meta")
    layer.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().to(weight.dtype), requires_grad=False)
    return layer.requires_grad_(False)


def dense_linear(layer: nn.Module, dtype: torch.dtype, cls: type[nn.Linear] = nn.Linear) -> nn.Linear:
    """``layer``'s weight dequantized once into a ``cls`` of ``dtype``: full speed, no memory saving."""
    return linear_over(cls, layer.dequantized_weight(dtype).contiguous(), layer.bias)
