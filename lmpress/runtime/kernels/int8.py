"""W8A8 in the runtime: int8 weights and per-token int8 activations through ``torch._int_mm`` (CPU and CUDA).

The same execution as a W8A8 ``QuantizedLinear`` (``weights/int8_linear.py``), with
the int8 weight transposed once at load and the packed codes dropped.
"""

from __future__ import annotations

import torch
from torch import nn

from lmpress.weights.int8_linear import int8_weight, w8a8_linear
from lmpress.weights.qlinear import QuantizedLinear


class W8A8Linear(nn.Module):
    """``y = x Wᵀ + b`` with x quantized per token and one int8 GEMM (``int8_linear.w8a8_linear``)."""

    KERNEL = "int8-mm"

    def __init__(self, layer: QuantizedLinear) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.register_buffer("weight_t", int8_weight(layer.codes()).t().contiguous())
        self.register_buffer("weight_scale", layer.scales[:, 0].detach().float().clone())
        self.register_buffer("bias", None if layer.bias is None else layer.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w8a8_linear(x, self.weight_t, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, W8A8 int8 per-token"
