"""Matmul and norm kernels for quantized weights, one module per device (``cpu.py``; ``cuda.py`` over ``triton.py``).

``LINEAR_KERNELS`` maps a kernel family to the function turning a ``QuantizedLinear``
into the module that runs it; the runtime picks the family from the device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lmpress.quantize.qlinear import QuantizedLinear


def dense_linear(layer: QuantizedLinear, dtype: torch.dtype, cls: type[nn.Linear] = nn.Linear) -> nn.Linear:
    """``layer``'s weight dequantized once into a ``cls`` of ``dtype``: full speed, no memory saving."""
    bias = layer.bias
    dense = cls(layer.in_features, layer.out_features, bias=bias is not None, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(layer.dequantized_weight(dtype))
        if bias is not None:
            dense.bias.copy_(bias.detach().float())
    return dense.requires_grad_(False)


def as_is(layer: QuantizedLinear, dtype: torch.dtype) -> nn.Module:
    return layer


def linear_kernel(family: str) -> Callable[[QuantizedLinear, torch.dtype], nn.Module]:
    """``"cpu"``: torch's packed int4/int8 kernels; ``"triton"``: the Triton W4A16/W8A16 kernels (CUDA);
    ``"reference"``: the ``QuantizedLinear`` itself, shared (the numerics of lmpress's evals, no copy).

    W8A8 layers (int8 activations) run ``torch._int_mm`` in every family but "reference" (``kernels/int8.py``):
    a weight-only kernel would silently drop their activation quantization."""
    if family == "reference":
        return as_is
    if family == "cpu":
        from lmpress.runtime.kernels.cpu import cpu_linear as weight_only
    elif family == "triton":
        from lmpress.runtime.kernels.cuda import triton_linear as weight_only
    else:
        raise ValueError(f"unknown kernel family {family!r} (cpu, triton, reference)")

    def kernel(layer: QuantizedLinear, dtype: torch.dtype) -> nn.Module:
        if layer.scheme.activations == "int8":
            from lmpress.runtime.kernels.int8 import W8A8Linear

            return W8A8Linear(layer)
        return weight_only(layer, dtype)

    return kernel
