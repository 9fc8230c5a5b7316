"""CUDA matmuls for quantized weights: the Triton W4A16 / W8A16 kernels (``triton.py``) as modules.

Weights are repacked once at load into the kernels' layout; each call runs the GEMV
kernel for up to ``DECODE_MAX_ROWS`` rows (decode) and the tiled GEMM above (prefill).
Activations go in as float16 or bfloat16 (the runtime's dtype on a GPU). Layouts the
kernels cannot run (2/3 bits, group widths that are not a power of two, act-order
groups of unequal size) fall back to a dense weight, as on the CPU.

The kernels enter the model as custom ops (``lmpress::triton_qmatmul``, ``lmpress::triton_rms_norm``),
so ``torch.compile`` treats each as one opaque call with a known output shape instead of tracing
the autotuner, and a CUDA graph captures their launches.
"""

from __future__ import annotations

import torch
from torch import nn

from lmpress.quantize.qlinear import QuantizedLinear
from lmpress.runtime.kernels import dense_linear

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@torch.library.custom_op("lmpress::triton_qmatmul", mutates_args=())
def triton_qmatmul(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    in_features: int,
    block: int,
    zero: int,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` by the Triton kernels for the packed tensors of a ``PackedWeight``."""
    from lmpress.runtime.kernels import triton as tk

    packed = tk.PackedWeight(bits, in_features, words.shape[0], block, words, scales, zeros, zero, perm, bias)
    return (tk.w4a16_matmul if bits == 4 else tk.w8a16_matmul)(x, packed)


@triton_qmatmul.register_fake
def _(x, words, scales, zeros, perm, bias, bits, in_features, block, zero) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], words.shape[0]))


@torch.library.custom_op("lmpress::triton_rms_norm", mutates_args=())
def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis by the fused Triton kernel."""
    from lmpress.runtime.kernels.triton import rms_norm

    return rms_norm(x, weight, eps)


@triton_rms_norm.register_fake
def _(x, weight, eps) -> torch.Tensor:
    return torch.empty_like(x)


class TritonLinear(nn.Module):
    """A quantized linear layer run by ``w4a16_matmul`` / ``w8a16_matmul``; the packed tensors are buffers."""

    def __init__(self, packed) -> None:
        super().__init__()
        self.bits, self.in_features, self.out_features = packed.bits, packed.in_features, packed.out_features
        self.block, self.zero = packed.block, packed.zero
        for name in ("words", "scales", "zeros", "perm", "bias"):
            self.register_buffer(name, getattr(packed, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = x if x.dtype in KERNEL_DTYPES else x.to(torch.bfloat16)
        y = triton_qmatmul(
            act, self.words, self.scales, self.zeros, self.perm, self.bias,
            self.bits, self.in_features, self.block, self.zero,
        )  # fmt: skip
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        act = ", act-order" if self.perm is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, w{self.bits}a16 c{self.block}{act}"


def triton_linear(layer: QuantizedLinear, dtype: torch.dtype) -> nn.Module:
    """The Triton module for ``layer``, else its weight dequantized once into a dense ``nn.Linear``."""
    from lmpress.runtime.kernels import triton as tk

    prepare = {4: tk.prepare_w4a16, 8: tk.prepare_w8a16}.get(layer.scheme.bits)
    if prepare is not None:
        try:
            return TritonLinear(prepare(layer))
        except ValueError:
            pass  # a layout the kernels do not take: dense below
    return dense_linear(layer, dtype)
