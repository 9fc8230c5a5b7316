"""FP8 W8A8 in the runtime: E4M3 weights and per-token E4M3 activations through ``torch._scaled_mm``.

The same function as ``quantize.fp8.Fp8Linear`` (``y = (Q(x) Q(W)ᵀ) · s_x · s_W``) with the
weight scales laid out once as the ``(1, N)`` row-wise factor ``_scaled_mm`` takes (a per-tensor
scale repeated), and the product written in bf16: cuBLAS's row-wise FP8 GEMM writes only bf16
outside sm90 with cuBLAS >= 12.9 (torch's ScaledBlas.cpp), so bf16 is the one output that runs on
every FP8 GPU. On CUDA it needs compute capability 8.9+ (Ada, Hopper) and K, N multiples of 16
(``select.kernel_candidates``); torch's CPU ``_scaled_mm`` takes the same call, which is how the
math is tested without a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from lmpress.weights.float8 import Fp8Linear, quantize_fp8_per_token


class ScaledMMLinear(nn.Module):
    """``Fp8Linear``'s product as one ``torch._scaled_mm`` (row-wise activation and weight scales)."""

    KERNEL = "fp8-scaled-mm"

    def __init__(self, layer: Fp8Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        scale = layer.weight_scale.detach().float().reshape(1, -1).expand(1, layer.out_features)
        self.register_buffer("weight", layer.weight.detach().clone())
        self.register_buffer("weight_scale", scale.contiguous())
        self.register_buffer("bias", None if layer.bias is None else layer.bias.detach().float().clone())

    def _apply(self, fn, recurse=True):
        weight, scale = self.weight, self.weight_scale  # E4M3 codes and fp32 scales: only the device follows
        result = super()._apply(fn, recurse)
        self.weight, self.weight_scale = weight.to(device=self.weight.device), scale.to(device=self.weight.device)
        return result

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        codes, x_scale = quantize_fp8_per_token(flat)
        y = torch._scaled_mm(
            codes, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale, out_dtype=torch.bfloat16
        )
        if self.bias is not None:
            y = y.float() + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, FP8 W8A8 _scaled_mm"


class Fp8SimulatedLinear(Fp8Linear):
    """``Fp8Linear`` simulated (the CPU; on an FP8 GPU, a layer whose sides are not multiples of 16): its E4M3
    weight values converted to float32 once, which decoding needs (``Fp8Linear`` converts them at each call, to hold
    1 byte per weight)."""

    KERNEL = "fp8-simulated"

    def __init__(self, layer: Fp8Linear) -> None:
        nn.Module.__init__(self)  # not Fp8Linear's: it would allocate a weight of zeros that this one replaces
        self.in_features, self.out_features, self.strategy = layer.in_features, layer.out_features, layer.strategy
        self.register_buffer("weight", layer.weight.detach())
        self.register_buffer("weight_scale", layer.weight_scale.detach())
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach(), requires_grad=False)
        self.values = layer.weight.detach().float()

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self.values = self.values.to(device=self.weight.device)  # float32 whatever the runtime's dtype
        return result

    def multiplies_in_fp8(self, device: torch.device) -> bool:
        return False

    def simulated_weight(self) -> torch.Tensor:
        return self.values.t()
