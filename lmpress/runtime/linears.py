"""The runtime's linear layers and norms, built from a transformers model's: how a model is built (``Build``),
RMSNorm, and several linears over one input fused into one matmul (dense or packed), or run as they are where the
runtime shares the model's own layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from lmpress.errors import LmpressInputError
from lmpress.runtime.kernels import DEFAULT_CPU_ACTIVATIONS, cpu_half, cpu_probe, linear_kernel
from lmpress.runtime.kernels.dense import linear_over
from lmpress.runtime.kernels.fwht import blockwise_hadamard, rotation_path
from lmpress.weights.float8 import Fp8Linear
from lmpress.weights.fp4 import Fp4Linear
from lmpress.weights.online_rotation import input_rotation_of
from lmpress.weights.qlinear import QuantizedLinear, trivial_g_idx


@dataclass(frozen=True)
class Build:
    """How the runtime model is built: the dtype of its activations and dense weights, and its kernels."""

    dtype: torch.dtype
    kernels: str = "cpu"  # kernels.FAMILIES: "cpu", "cuda" (select.py's pick per layer), "triton", "reference"
    map_embedding: bool = False  # use the embedding table as given (memory-mapped) where it has ``dtype``
    cpu_activations: str = DEFAULT_CPU_ACTIVATIONS  # weight-only layers on the CPU: "int8" or "bf16" activations

    @property
    def shares_layers(self) -> bool:
        """Whether the model's own linear layers run as they are, unfused and uncopied ("reference" kernels)."""
        return self.kernels == "reference"

    @property
    def dense_linear(self) -> type[nn.Linear]:
        """The module class of float linear layers (their weights copied into it)."""
        if self.kernels == "cpu":
            from lmpress.runtime.kernels.cpu import DenseLinear

            return DenseLinear
        return nn.Linear

    def dense_dtype(self, weight: torch.Tensor) -> torch.dtype:
        """The dtype float ``weight`` is kept in: as stored where it is bfloat16 or float16 in a float32 CPU build
        that lmpress's half-weight op runs (``kernels/cpu_half.py``: the same float32 products from half the
        bytes), else the build's."""
        if self.kernels == "cpu" and cpu_half.fits(weight, self.dtype):
            return weight.dtype
        return self.dtype

    def dense(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        """A float layer over ``weight`` (used as it is) and ``bias``, in ``dense_dtype(weight)``."""
        if self.dense_dtype(weight) != self.dtype:  # the op's variant probed for this host and shape
            choice = cpu_probe.choose_half_kernel(*weight.shape, weight.dtype)
            return cpu_half.HalfWeightLinear(weight, bias, choice.isa, choice.prefetch, choice.rows)
        return linear_over(self.dense_linear, weight.to(self.dtype), bias)

    def rotation_path(self, block: int) -> str:
        """How this build's layers turn their inputs online in blocks of ``block`` (``kernels/fwht.py``)."""
        device = {"cpu": "cpu", "cuda": "cuda", "triton": "cuda"}.get(self.kernels, "reference")
        return rotation_path(device, self.dtype, block)

    @property
    def quantized_linear(self) -> Callable[[QuantizedLinear, torch.dtype], nn.Module]:
        return linear_kernel(self.kernels, self.cpu_activations)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, fused: bool = False) -> None:
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from lmpress.runtime.kernels.cuda import triton_rms_norm

            return triton_rms_norm(x, self.weight, self.eps)
        # One fused op. In float32 it equals transformers' x * rsqrt(mean(x^2) + eps) * weight bit for bit;
        # in half precision it scales before the final rounding where transformers rounds first (1 ulp apart).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(self, added: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + added), x + added)``: the residual stream's add and this norm (``(norm(x), x)`` for no
        ``added``), one Triton launch in a CUDA build, the same two ops as unfused elsewhere."""
        if added is None:
            return self(x), x
        if self.fused:
            from lmpress.runtime.kernels.cuda import triton_add_rms_norm

            return triton_add_rms_norm(x, added, self.weight, self.eps)
        x = x + added
        return self(x), x


class FusedLinear(nn.Module):
    """Several linears over one input, as one output ``cat(outputs, -1)``: one matmul where they fuse."""

    def __init__(self, parts: list[nn.Module], sizes: list[int]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.sizes = sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0](x)
        return torch.cat([part(x) for part in self.parts], dim=-1)


class RotatedInputLinear(nn.Module):
    """A runtime linear whose model layer turns its input first (R4, ``online_rotation.py``): ``linear(x V)``, the
    turn by the runtime's kernels (``kernels/fwht.py``)."""

    def __init__(self, block: int, linear: nn.Module, path: str = "torch") -> None:
        super().__init__()
        self.block, self.linear, self.path = block, linear, path  # path: fwht.PATHS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(blockwise_hadamard(x, self.block, self.path))

    def extra_repr(self) -> str:
        return f"block={self.block}, path={self.path}"


def fuse_linears(layers: list[nn.Module], build: Build) -> FusedLinear:
    """One module computing every layer of ``layers`` on the same input, outputs concatenated. Layers whose
    input the model turns online (``online_rotation.py``) must all turn it alike: the input is turned once, before
    the fused parts (a part that is the model's own layer, shared, turns it itself)."""
    blocks = {None if (r := input_rotation_of(layer)) is None else r.block for layer in layers}
    fused = _fuse_unrotated(layers, build)
    if blocks == {None}:
        return fused
    if len(blocks) != 1:
        raise LmpressInputError("the runtime fuses linears over one input only where they turn it alike")
    block = blocks.pop()
    parts = [
        part if any(part is layer for layer in layers) else RotatedInputLinear(block, part, build.rotation_path(block))
        for part in fused.parts
    ]
    return FusedLinear(parts, fused.sizes)


def _fuse_unrotated(layers: list[nn.Module], build: Build) -> FusedLinear:
    sizes = [layer.out_features for layer in layers]
    if build.shares_layers:
        return FusedLinear([runtime_linear(layer, build) for layer in layers], sizes)
    if all(type(layer) is nn.Linear for layer in layers):
        return FusedLinear([_concat_dense(layers, build)], sizes)
    if all(isinstance(layer, Fp4Linear) and layer.scheme.activations is None for layer in layers):
        fused = None
        if build.kernels == "cpu" and build.cpu_activations == "int8":
            from lmpress.runtime.kernels.cpu_fp4 import fp4_cpu_fused

            fused = fp4_cpu_fused(layers)  # lmpress's FP4 x int8 kernel, where it holds the layers
        return FusedLinear([fused if fused is not None else _dequantized_dense(layers, build)], sizes)
    if all(isinstance(layer, QuantizedLinear) for layer in layers) and _quantized_fusable(layers):
        return FusedLinear([build.quantized_linear(_concat_quantized(layers), build.dtype)], sizes)
    return FusedLinear([runtime_linear(layer, build) for layer in layers], sizes)


def runtime_linear(layer: nn.Module, build: Build) -> nn.Module:
    if isinstance(layer, (QuantizedLinear, Fp8Linear, Fp4Linear)):
        return build.quantized_linear(layer, build.dtype)
    if type(layer) is nn.Linear:
        if build.shares_layers and layer.weight.dtype == build.dtype:
            return layer
        return _concat_dense([layer], build)
    if runs_itself(layer):
        return layer
    raise LmpressInputError(
        f"the runtime cannot run a {type(layer).__name__} layer (nn.Linear, QuantizedLinear, Fp8Linear or Fp4Linear)"
    )


def runs_itself(layer: nn.Module) -> bool:
    """Whether ``layer`` is a quantized linear the runtime runs through its own forward, shared:
    bitsandbytes' ``Linear8bitLt`` / ``Linear4bit``. Their ``weight`` holds codes (int8, packed 4-bit),
    never the float weight, so copying it into a dense layer would run unscaled codes."""
    return isinstance(layer, nn.Linear) and type(layer).__module__.startswith("bitsandbytes.")


def _concat_dense(layers: list[nn.Linear], build: Build) -> nn.Module:
    """One float layer of ``layers``' rows, its weight a copy (never a view into a checkpoint's mapped file)."""
    weight = torch.cat([layer.weight.detach() for layer in layers])
    biased = any(layer.bias is not None for layer in layers)
    return build.dense(weight, torch.cat([_bias_or_zeros(layer) for layer in layers]) if biased else None)


def _dequantized_dense(layers: list[Fp4Linear], build: Build) -> nn.Module:
    """One float layer of ``layers``' dequantized weights (rows concatenated), in the build's dtype."""
    weight = torch.cat([layer.dequantized_weight(torch.float32) for layer in layers]).to(build.dtype)
    biased = any(layer.bias is not None for layer in layers)
    return build.dense(weight, torch.cat([_bias_or_zeros(layer) for layer in layers]) if biased else None)


def _bias_or_zeros(layer: nn.Module) -> torch.Tensor:
    if layer.bias is None:
        return torch.zeros(layer.out_features)
    return layer.bias.detach().float()


def _quantized_fusable(layers: list[QuantizedLinear]) -> bool:
    first = layers[0]
    return all(
        layer.scheme == first.scheme
        and layer.in_features == first.in_features
        and layer.scales.dtype == first.scales.dtype
        and trivial_g_idx(layer.g_idx, layer.in_features, layer.scheme)
        for layer in layers
    )


def _concat_quantized(layers: list[QuantizedLinear]) -> QuantizedLinear:
    """Stack the layers' rows: codes are packed along the input axis, so rows concatenate as they are."""
    first = layers[0]
    biased = any(layer.bias is not None for layer in layers)
    out_features = sum(layer.out_features for layer in layers)
    fused = QuantizedLinear(first.in_features, out_features, first.scheme, biased, first.scales.dtype)
    fused.qweight.copy_(torch.cat([layer.qweight for layer in layers]))
    fused.scales.copy_(torch.cat([layer.scales for layer in layers]))
    fused.zeros.copy_(torch.cat([layer.zeros for layer in layers]))
    if biased:
        with torch.no_grad():
            fused.bias.copy_(torch.cat([_bias_or_zeros(layer) for layer in layers]))
    return fused


def copy_norm(hf_norm: nn.Module, eps: float, build: Build, offset: float = 0.0) -> RMSNorm:
    """The runtime's RMSNorm for ``hf_norm``; ``offset`` 1 for norms scaling by (1 + weight) (Gemma's)."""
    eps = getattr(hf_norm, "variance_epsilon", getattr(hf_norm, "eps", eps))
    norm = RMSNorm(hf_norm.weight.shape[0], eps, build.dtype, fused=build.kernels in ("cuda", "triton"))
    with torch.no_grad():
        norm.weight.copy_(hf_norm.weight.float() + offset)
    return norm
