"""CUDA matmuls for quantized weights: the Triton W4A16 / W8A16 kernels (``triton.py``) as modules.

Weights are repacked once at load into the kernels' layout; each call runs the GEMV
kernel for up to ``DECODE_MAX_ROWS`` rows (decode) and the tiled GEMM above (prefill).
Activations go in as float16 or bfloat16 (the runtime's dtype on a GPU). Layouts the
kernels cannot run (2/3 bits, group widths that are not a power of two, act-order
groups of unequal size) fall back to a dense weight, as on the CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from lmpress.quantize.qlinear import QuantizedLinear
from lmpress.runtime.kernels import dense_linear

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


class TritonLinear(nn.Module):
    """A quantized linear layer run by ``w4a16_matmul`` / ``w8a16_matmul``; the packed tensors are buffers."""

    def __init__(self, packed) -> None:
        super().__init__()
        self.bits, self.in_features, self.out_features = packed.bits, packed.in_features, packed.out_features
        self.block, self.zero = packed.block, packed.zero
        for name in ("words", "scales", "zeros", "perm", "bias"):
            self.register_buffer(name, getattr(packed, name))

    def packed(self):
        from lmpress.runtime.kernels.triton import PackedWeight

        return PackedWeight(
            bits=self.bits,
            in_features=self.in_features,
            out_features=self.out_features,
            block=self.block,
            words=self.words,
            scales=self.scales,
            zeros=self.zeros,
            zero=self.zero,
            perm=self.perm,
            bias=self.bias,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lmpress.runtime.kernels import triton as tk

        act = x if x.dtype in KERNEL_DTYPES else x.to(torch.bfloat16)
        matmul = tk.w4a16_matmul if self.bits == 4 else tk.w8a16_matmul
        return matmul(act, self.packed()).to(x.dtype)

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
