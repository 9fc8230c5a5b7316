"""Matmul and norm kernels for quantized weights (``select.py`` decides which runs each layer).

``linear_kernel(family)`` returns the function turning a ``QuantizedLinear`` (or an FP8
``Fp8Linear``, or an FP4 ``Fp4Linear``) into the module that runs it: ``"cpu"`` (torch's packed CPU kernels), ``"cuda"``
(per layer, the fastest that holds it: tinygemm, gemlite, lmpress's Triton kernels, ``_int_mm``,
``_scaled_mm``), ``"triton"`` (lmpress's Triton kernels wherever they hold the layer: tests under
the interpreter, benches) or ``"reference"`` (the layer itself). ``kernel_of(module)`` names the
kernel a built module runs (``lmpress bench`` prints it per layer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lmpress.runtime.kernels.cpu_int import CPU_ACTIVATIONS, DEFAULT_CPU_ACTIVATIONS
from lmpress.runtime.kernels.dense import dense_linear
from lmpress.weights.qlinear import QuantizedLinear

FAMILIES = ("cpu", "cuda", "triton", "reference")


def as_is(layer: nn.Module, dtype: torch.dtype) -> nn.Module:
    return layer


def kernel_of(module: nn.Module) -> str:
    """The name (``select.KERNELS``) of the kernel a module built by ``linear_kernel`` (or a float layer) runs."""
    name = getattr(type(module), "KERNEL", None)
    if isinstance(name, str):
        return name
    if isinstance(module, QuantizedLinear):
        return "int8-mm" if module.int8_matmul_holds else "reference"
    if isinstance(module, nn.Linear):
        return "dense"
    from lmpress.weights.float8 import Fp8Linear

    if isinstance(module, Fp8Linear):
        return "fp8-simulated"
    from lmpress.weights.fp4 import Fp4Linear

    if isinstance(module, Fp4Linear):
        return "fp4-simulated" if module.scheme.activations == "fp4" else "reference"
    return type(module).__name__


def build_kernel(name: str, layer: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The module running ``layer`` on kernel ``name`` (one of ``select.KERNELS``)."""
    if name == "tinygemm":
        from lmpress.runtime.kernels.tinygemm import tinygemm_linear

        return tinygemm_linear(layer)
    if name == "gemlite":
        from lmpress.runtime.kernels.gemlite import GemliteLinear

        return GemliteLinear(layer, dtype)
    if name == "triton":
        from lmpress.runtime.kernels.cuda import triton_linear

        return triton_linear(layer, dtype)
    if name == "int8-mm":
        from lmpress.runtime.kernels.int8 import W8A8Linear

        return W8A8Linear(layer)
    if name == "fp8-scaled-mm":
        from lmpress.runtime.kernels.fp8 import ScaledMMLinear

        return ScaledMMLinear(layer)
    if name == "fp4-simulated":
        from lmpress.runtime.kernels.dense import fp4_activations_linear

        return fp4_activations_linear(layer, dtype)
    if name == "int8-simulated":
        from lmpress.runtime.kernels.dense import Int8ActivationsLinear

        return dense_linear(layer, dtype, Int8ActivationsLinear)
    if name == "fp8-simulated":
        from lmpress.runtime.kernels.fp8 import Fp8SimulatedLinear

        return Fp8SimulatedLinear(layer)
    if name == "reference":
        return layer
    if name in ("cpu-w4a8", "cpu-w8a8", "cpu-int4", "cpu-int8"):
        from lmpress.runtime.kernels.cpu import cpu_linear

        return cpu_linear(layer, dtype, "int8" if name in ("cpu-w4a8", "cpu-w8a8") else "bf16")
    if name == "cpu-fp4a8":
        from lmpress.runtime.kernels.cpu_fp4 import fp4_cpu_module

        return fp4_cpu_module(layer) or dense_linear(layer, dtype)
    if name == "dense":
        return dense_linear(layer, dtype)
    raise ValueError(f"unknown kernel {name!r}")


def linear_kernel(
    family: str, cpu_activations: str = DEFAULT_CPU_ACTIVATIONS
) -> Callable[[nn.Module, torch.dtype], nn.Module]:
    """The builder of quantized layers' modules for kernel ``family`` (see the module docstring); on the CPU,
    weight-only layers take their activations as ``cpu_activations`` (``CPU_ACTIVATIONS``).

    W8A8 layers (int8 activations) run lmpress's int8 kernel on the CPU where it builds (``cpu_int.py``, summing in
    int32 as ``torch._int_mm``), else ``_int_mm`` (``kernels/int8.py``), in every family but "reference"; FP8 layers
    ``_scaled_mm`` where the GPU has FP8 tensor cores: a weight-only kernel would silently drop their activation
    quantization. FP4 layers run dequantized (``select.kernel_candidates``)."""
    if family == "reference":
        return as_is
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r} ({', '.join(FAMILIES)})")
    check_cpu_activations(cpu_activations)
    from lmpress.runtime.kernels.select import DeviceCase, LayerCase, kernel_candidates

    def kernel(layer: nn.Module, dtype: torch.dtype) -> nn.Module:
        case = LayerCase.of(layer)
        if family == "cuda":
            from lmpress.runtime.kernels.cuda import cuda_kernel_name

            return build_kernel(cuda_kernel_name(layer, case, dtype, build_kernel), layer, dtype)
        if case.fp4 is not None and case.activations is None and family == "cpu":
            if cpu_activations == "int8":  # lmpress's FP4 x int8 kernel (cpu_fp4.cpp) where it holds the layer
                from lmpress.runtime.kernels.cpu_fp4 import fp4_cpu_module

                module = fp4_cpu_module(layer)
                if module is not None:
                    return module
            from lmpress.runtime.kernels.cpu import DenseLinear

            return dense_linear(layer, dtype, DenseLinear)  # FP4 A16 elsewhere: dequantized once
        if case.activations is not None or case.fp4 is not None:
            return build_kernel(kernel_candidates(case, DeviceCase("cpu", dtype))[0], layer, dtype)
        if family == "triton":
            return build_kernel("triton", layer, dtype)
        from lmpress.runtime.kernels.cpu import cpu_linear

        return cpu_linear(layer, dtype, cpu_activations)  # a packed kernel (as select names it), else DenseLinear

    return kernel


def check_cpu_activations(activations: str) -> None:
    """An input error unless ``activations`` is one of ``CPU_ACTIVATIONS``."""
    if activations not in CPU_ACTIVATIONS:
        from lmpress.errors import LmpressInputError

        raise LmpressInputError(f"activations {activations!r}: choose {' or '.join(CPU_ACTIVATIONS)}")
