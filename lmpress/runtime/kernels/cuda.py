"""CUDA matmuls for quantized weights: which kernel runs a layer on this GPU, and lmpress's Triton kernels as modules.

``cuda_kernel_name`` asks ``select.select_kernel`` with this GPU's facts; where two library kernels
both hold a layer (tinygemm and gemlite) it times them once per shape (``tuning.tuned_choice``, kept
on disk). The Triton W4A16 / W8A16 kernels (``triton.py``) run as ``TritonLinear``.

Weights are repacked once at load into the kernels' layout; each call runs the GEMV
kernel for up to ``DECODE_MAX_ROWS`` rows (decode) and the tiled GEMM above (prefill).
Activations go in as float16 or bfloat16 (the runtime's dtype on a GPU). Layouts the
kernels cannot run (2/3 bits, group widths that are not a power of two, act-order
groups of unequal size) fall back to a dense weight, as on the CPU.

The kernels enter the model as custom ops (``lmpress::triton_qmatmul``, ``lmpress::triton_rms_norm``,
``lmpress::triton_decode_attention``),
so ``torch.compile`` treats each as one opaque call with a known output shape instead of tracing
the autotuner, and a CUDA graph captures their launches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lmpress.runtime.kernels.dense import dense_linear
from lmpress.runtime.kernels.select import DeviceCase, LayerCase, select_kernel
from lmpress.runtime.kernels.tuning import tuned_choice
from lmpress.weights.qlinear import QuantizedLinear

KernelBuilder = Callable[[str, nn.Module, torch.dtype], nn.Module]  # (name, layer, dtype): kernels.build_kernel

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


@torch.library.custom_op("lmpress::triton_add_rms_norm", mutates_args=())
def triton_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one launch of the Triton kernel: a block's residual add and
    the next norm, read and written once."""
    from lmpress.runtime.kernels.triton import rms_norm

    return rms_norm(x, weight, eps, residual)


@triton_add_rms_norm.register_fake
def _(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("lmpress::triton_decode_attention", mutates_args=())
def triton_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    key_scales: torch.Tensor | None,
    values: torch.Tensor,
    value_scales: torch.Tensor | None,
    mask: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    recent_keys: torch.Tensor | None,
) -> torch.Tensor:
    """A static step's attention over the cache's stored entries or codes (``triton_attention.decode_attention``;
    ``recent_keys``: the float ring of KIVI's INT4 keys, else None)."""
    from lmpress.runtime.kernels.triton_attention import decode_attention

    return decode_attention(q, keys, key_scales, values, value_scales, mask, pos, scale, recent_keys)


@triton_decode_attention.register_fake
def _(q, keys, key_scales, values, value_scales, mask, pos, scale, recent_keys) -> torch.Tensor:
    return torch.empty_like(q)


class TritonLinear(nn.Module):
    """A quantized linear layer run by ``w4a16_matmul`` / ``w8a16_matmul``; the packed tensors are buffers."""

    KERNEL = "triton"

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


def cuda_seconds(run, repeats: int = 20) -> float:
    """Median seconds of ``run()`` on the current CUDA stream (CUDA events), after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def fastest_kernel(
    layer: nn.Module, case: LayerCase, names: tuple[str, ...], dtype: torch.dtype, build: KernelBuilder
) -> str:
    """Which of ``names`` runs ``layer`` fastest for one row (a decode step) on the current GPU: timed once per
    shape, GPU and versions, then read from the tuning cache. ``build(name, layer, dtype)`` makes each module."""
    device = torch.device("cuda", torch.cuda.current_device())
    shape = {"N": case.out_features, "K": case.in_features, "bits": case.bits, "group": case.group_width}
    shape |= {"act_order": case.act_order, "dtype": str(dtype)}

    def seconds(name: str) -> float:
        module = build(name, layer, dtype).to(device)
        x = torch.randn(1, case.in_features, dtype=dtype, device=device)
        return cuda_seconds(lambda: module(x))

    return tuned_choice(torch.cuda.get_device_name(device), "weight_only_kernel", shape, list(names), seconds)


def cuda_kernel_name(layer: nn.Module, case: LayerCase, dtype: torch.dtype, build: KernelBuilder) -> str:
    """The kernel that runs ``layer`` on the current CUDA device (``select.select_kernel``)."""
    here = DeviceCase.here(torch.device("cuda", torch.cuda.current_device()), dtype)
    return select_kernel(case, here, measure=lambda names: fastest_kernel(layer, case, names, dtype, build))
