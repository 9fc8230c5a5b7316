"""Which kernel runs a quantized layer: one decision from the layer's scheme, the device and what is installed.

``kernel_candidates(layer, device)`` lists every kernel that can represent the layer on the device,
expected-fastest first; ``select_kernel`` takes the first, or, where a ``measure`` callback is given
and more than one fast kernel applies (tinygemm and gemlite), the one it times fastest.
Nothing here touches a GPU: the facts come in as ``LayerCase`` and ``DeviceCase``, so the whole
table is tested on the CPU. The reasons for the order are in docs/kernels.md.

Kernel names (``KERNELS``) are what ``lmpress bench`` prints for each layer.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

KERNELS = {
    "tinygemm": "torch _weight_int4pack_mm (CUDA tinygemm), W4 bf16",
    "gemlite": "gemlite Triton GEMV/GEMM (optional [gpu] extra)",
    "triton": "lmpress Triton W4A16/W8A16 (act-order, W8)",
    "int8-mm": "torch _int_mm, W8A8 (int8 activations)",
    "fp8-scaled-mm": "torch _scaled_mm, FP8 W8A8 (sm89+)",
    "fp8-simulated": "FP8 W8A8 simulated in float (E4M3 values converted to float32 once, no FP8 tensor cores)",
    "cpu-w4a8": "lmpress C++ int4 x int8 dot (AVX-512 VNNI / AVX2), activations int8 per 4 (per token: W4A8)",
    "cpu-w8a8": "lmpress C++ int8 x int8 dot, per-row weights (AVX-512 VNNI / AVX2), int8 activations per 4; per token "
    "(W8A8) summed in int32 as _int_mm (AVX2)",
    "cpu-int4": "torch _weight_int4pack_mm_for_cpu",
    "cpu-int8": "torch _weight_int8pack_mm",
    "fp4-simulated": "FP4 W4A4 simulated in float (activations fake-quantized per block, weight dequantized once)",
    "dense": "weight dequantized once, dense matmul (FP4 A16 layers too)",
    "cpu-fp4a8": "lmpress C++ NVFP4/MXFP4 x int8 activations per 4 (AVX-512 VNNI / AVX2, cpu_fp4.cpp)",
    "int8-simulated": "W4A8 simulated in float (activations fake-quantized per token, weight dequantized once)",
    "reference": "lmpress QuantizedLinear (dequantize per call)",
}
# Group widths tinygemm holds natively; a wider group that is a multiple of one repeats its scales.
TINYGEMM_GROUPS = (256, 128, 64, 32)
TINYGEMM_MIN_CAPABILITY = (8, 0)  # bf16 mma.sync m16n8k16 (int4mm.cu compiles the kernel for sm80+ only)
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper
GEMLITE_BITS = (1, 2, 4, 8)


@dataclass(frozen=True)
class LayerCase:
    """What the kernel choice needs to know about one layer."""

    bits: int
    group_width: int  # columns per scale (in_features for per-channel)
    in_features: int
    out_features: int
    act_order: bool = False  # a non-trivial g_idx
    equal_groups: bool = True  # act-order groups all hold group_width columns (GPTQ's do)
    activations: str | None = None  # None (weight-only), "int8" (W8A8), "fp8" or "fp4" (W4A4)
    fp4: str | None = None  # "nvfp4" or "mxfp4": E2M1 weights with block scales (Fp4Linear)
    symmetric: bool = True

    @classmethod
    def of(cls, layer: torch.nn.Module) -> LayerCase:
        """The case of a ``QuantizedLinear``, an ``Fp8Linear`` or an ``Fp4Linear``."""
        from lmpress.weights.fp4 import Fp4Linear
        from lmpress.weights.qlinear import QuantizedLinear, trivial_g_idx

        if isinstance(layer, Fp4Linear):
            scheme = layer.scheme
            k, n = layer.in_features, layer.out_features
            return cls(4, scheme.group_size, k, n, activations=scheme.activations, fp4=layer.fmt)
        if not isinstance(layer, QuantizedLinear):  # Fp8Linear: E4M3 weights, per-token E4M3 activations
            return cls(8, layer.in_features, layer.in_features, layer.out_features, activations="fp8")
        scheme, k = layer.scheme, layer.in_features
        width = scheme.group_width(k)
        act_order = not trivial_g_idx(layer.g_idx, k, scheme)
        equal = True
        if act_order:
            counts = torch.bincount(layer.g_idx.long(), minlength=layer.scales.shape[1])
            equal = bool((counts == width).all())
        return cls(
            scheme.bits, width, k, layer.out_features, act_order, equal, scheme.activations, symmetric=scheme.symmetric
        )


def gemlite_installed() -> bool:
    return importlib.util.find_spec("gemlite") is not None


@dataclass(frozen=True)
class DeviceCase:
    """The device a layer will run on: its type, CUDA capability, the runtime's dtype, optional libraries."""

    type: str  # "cpu" or "cuda"
    dtype: torch.dtype = torch.bfloat16
    capability: tuple[int, int] | None = None
    libraries: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def here(cls, device: torch.device | str, dtype: torch.dtype) -> DeviceCase:
        device = torch.device(device)
        if device.type != "cuda":
            return cls(device.type, dtype)
        libraries = frozenset({"gemlite"} if gemlite_installed() else ())
        return cls("cuda", dtype, torch.cuda.get_device_capability(device), libraries)


def _tinygemm_holds(layer: LayerCase, device: DeviceCase) -> bool:
    """torch's CUDA int4 kernel: bf16 activations; N a multiple of 8; K of 32 (2 inner k-tiles of 16);
    groups of 32-256 columns (wider groups that are multiples of 32 repeat their scales); act-order only
    with equal groups (the activations are permuted, the codes sorted once)."""
    return (
        layer.bits == 4
        and device.dtype == torch.bfloat16
        and device.capability is not None
        and device.capability >= TINYGEMM_MIN_CAPABILITY
        and layer.out_features % 8 == 0
        and layer.in_features % 32 == 0
        and layer.group_width % 32 == 0
        and layer.equal_groups
    )


def _gemlite_holds(layer: LayerCase, device: DeviceCase) -> bool:
    """gemlite's A16Wn: 1/2/4/8 bits, fp16/bf16 activations, K a multiple of 32 and of the group (>= 16);
    no act-order (it takes the codes in column order)."""
    return (
        "gemlite" in device.libraries
        and layer.bits in GEMLITE_BITS
        and device.dtype in (torch.float16, torch.bfloat16)
        and not layer.act_order
        and layer.in_features % 32 == 0
        and layer.group_width >= 16
        and layer.in_features % layer.group_width == 0
    )


def _triton_holds(layer: LayerCase) -> bool:
    """lmpress's Triton kernels (triton_pack.py): 4 or 8 bits, a power-of-two group (per-channel too),
    act-order with equal groups."""
    per_channel = layer.group_width == layer.in_features
    width = 128 if per_channel else layer.group_width
    return layer.bits in (4, 8) and width % (32 // layer.bits) == 0 and width & (width - 1) == 0 and layer.equal_groups


def _cpu_int8_activations(layer: LayerCase) -> str | None:
    """lmpress's own CPU kernel (kernels/cpu_int.py) that holds the layer, if any (when it builds on the host)."""
    k, width = layer.in_features, layer.group_width
    if layer.act_order or k % 64:
        return None
    if layer.bits == 4 and width % 64 == 0 and k % width == 0:
        return "cpu-w4a8"
    if layer.bits == 8 and width == k:
        return "cpu-w8a8"
    return None


def _cpu_packed(layer: LayerCase) -> str | None:
    """The CPU packed kernel QuantizedLinear._prepare_kernel takes, if any."""
    if layer.bits == 8 and layer.group_width == layer.in_features:
        return "cpu-int8"
    if layer.bits == 4 and layer.out_features % 16 == 0 and layer.group_width % 32 == 0 and layer.equal_groups:
        return "cpu-int4"
    return None


def kernel_candidates(layer: LayerCase, device: DeviceCase) -> tuple[str, ...]:
    """Every kernel that runs ``layer`` on ``device``, expected-fastest first; the last always applies.

    An FP4 A16 layer runs lmpress's FP4 x int8 kernel on the CPU (cpu_fp4.cpp, where it holds the layer) and its
    weight dequantized once (the library's dense matmul) elsewhere; a W4A4 layer its weight dequantized once and
    its activations quantized per block at each call, as it was scored (``dense.Fp4ActivationsLinear``)."""
    if layer.fp4 is not None:
        if layer.activations == "fp4":
            return ("fp4-simulated",)
        return ("cpu-fp4a8", "dense") if device.type == "cpu" and layer.in_features % 64 == 0 else ("dense",)
    if layer.activations == "int8":  # a weight-only kernel would drop the activation quantization it was scored with
        # lmpress's int4 or int8 x int8 kernel on the CPU with the activations quantized per token, else torch's
        # int8 matmul (W8A8) or the simulation it was scored with (the weight dequantized once)
        w8a8 = layer.bits == 8 and layer.group_width == layer.in_features and layer.symmetric
        ours = _cpu_int8_activations(layer) if device.type == "cpu" else None
        fallback = "int8-mm" if w8a8 else "int8-simulated"
        return (ours, fallback) if ours in ("cpu-w4a8", "cpu-w8a8") else (fallback,)
    if layer.activations == "fp8":
        fp8 = device.type == "cuda" and device.capability is not None and device.capability >= FP8_MIN_CAPABILITY
        fp8 = fp8 and layer.in_features % 16 == 0 and layer.out_features % 16 == 0
        return ("fp8-scaled-mm", "fp8-simulated") if fp8 else ("fp8-simulated",)
    if device.type != "cuda":
        found = [name for name in (_cpu_int8_activations(layer), _cpu_packed(layer)) if name]
        return (*found, "dense")
    found = []
    if _tinygemm_holds(layer, device):
        found.append("tinygemm")
    if _gemlite_holds(layer, device):
        found.append("gemlite")
    if _triton_holds(layer):
        found.append("triton")
    return (*found, "dense")


# Candidates that a measurement may reorder: the library kernels whose relative speed depends on the shape.
MEASURED = ("tinygemm", "gemlite")


def select_kernel(layer: LayerCase, device: DeviceCase, measure: Callable[[tuple[str, ...]], str] | None = None) -> str:
    """The kernel to run ``layer`` with: the first candidate, or ``measure``'s pick among the measurable ones.

    ``measure`` receives the candidates in ``MEASURED`` (two or more) and returns the fastest; the runtime's
    is ``tuning.fastest_kernel`` (timed once per shape and GPU, then read from the on-disk cache).
    """
    candidates = kernel_candidates(layer, device)
    contenders = tuple(name for name in candidates if name in MEASURED)
    if measure is not None and len(contenders) > 1:
        return measure(contenders)
    return candidates[0]
