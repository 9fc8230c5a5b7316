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


class Fp4ActivationsLinear(nn.Linear):
    """An FP4 W4A4 layer in the runtime: its weight dequantized once, its activations quantized per block at each
    call as the layer was scored (``Fp4Linear`` itself dequantizes at each call, which decoding cannot afford)."""

    KERNEL = "fp4-simulated"
    fmt: str = "nvfp4"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lmpress.weights.fp4 import fake_quantize_fp4_activations

        return super().forward(fake_quantize_fp4_activations(x, self.fmt, self.input_global_scale))


class Int8ActivationsLinear(nn.Linear):
    """A W4A8 layer (integer weights in groups, int8 activations per token) in the runtime: its weight dequantized
    once, its activations fake-quantized per token at each call, as ``QuantizedLinear`` scores it (which
    dequantizes its weight at each call: 4 tok/s on SmolLM2 against 59 for its W4A16 twin)."""

    KERNEL = "int8-simulated"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lmpress.weights.int8_linear import fake_quantize_per_token

        return super().forward(fake_quantize_per_token(x))


def fp4_activations_linear(layer: nn.Module, dtype: torch.dtype) -> Fp4ActivationsLinear:
    """``layer`` (an ``Fp4Linear`` with FP4 activations) as an ``Fp4ActivationsLinear`` of ``dtype``."""
    module = dense_linear(layer, dtype, Fp4ActivationsLinear)
    module.fmt = layer.fmt
    module.register_buffer("input_global_scale", layer.input_global_scale)  # NVFP4's static scale; None for MXFP4
    return module
