"""Quantized layers on gemlite (``pip install 'lmpress[gpu]'``): Triton GEMV/GEMM kernels for 1/2/4/8-bit weights.

gemlite (mobiusml/gemlite, pure Python over Triton) dequantizes ``(W_q - zeros) * scales``
per group, lmpress's own convention, so the codes, scales and zeros go in as they are:
``gemlite.helper.A16Wn(device, dtype).from_weights(W_q, scales, zeros, W_nbits, group_size, bias)``
(gemlite 0.6). It imports only where CUDA is present (it reads the device's capability at
import), so the layer keeps lmpress's tensors until it moves to a GPU and builds gemlite's there.
"""

from __future__ import annotations

import torch
from torch import nn

from lmpress.weights.qlinear import QuantizedLinear


class GemliteLinear(nn.Module):
    """A quantized linear layer run by a gemlite ``GemLiteLinearTriton`` once on a GPU."""

    KERNEL = "gemlite"

    def __init__(self, layer: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.bits, self.group = layer.scheme.bits, layer.scheme.group_width(layer.in_features)
        self.dtype = dtype
        self.register_buffer("codes", layer.codes().contiguous())
        self.register_buffer("scales", layer.scales.detach().to(dtype).contiguous())
        self.register_buffer("zeros", layer.zeros.to(dtype).contiguous())
        self.register_buffer("bias", None if layer.bias is None else layer.bias.detach().to(dtype).clone())
        self.gemlite: nn.Module | None = None

    def _apply(self, fn, recurse=True):
        scales, zeros = self.scales, self.zeros
        result = super()._apply(fn, recurse)
        device = self.codes.device
        self.scales, self.zeros = scales.to(device=device), zeros.to(device=device)
        if device.type == "cuda" and self.gemlite is None:
            from gemlite.helper import A16Wn

            self.gemlite = A16Wn(device=str(device), dtype=self.dtype).from_weights(
                self.codes, self.scales, self.zeros, self.bits, self.group, self.bias
            )
            # gemlite holds its own packing: lmpress's copies are no longer read
            self.codes = self.scales = self.zeros = self.bias = None
        return result

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemlite is None:
            raise RuntimeError("a GemliteLinear runs on a CUDA GPU: move it there first")
        flat = x.reshape(-1, self.in_features).to(self.dtype)
        return self.gemlite(flat).to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, gemlite W{self.bits} g{self.group}"
