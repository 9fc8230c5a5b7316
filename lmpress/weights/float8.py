"""FP8 W8A8: E4M3 weights with per-channel or per-tensor scales, dynamic per-token E4M3 activations.

The format vLLM serves on Hopper GPUs (Micikevicius et al., "FP8 Formats for Deep
Learning", arXiv:2209.05433: E4M3 has 4 exponent and 3 mantissa bits, largest
finite value 448, no infinities). A weight is stored as ``W_fp8 = cast(W / s_W)``
with ``s_W = max|W| / 448`` per output row (``weights: channel``) or for the
whole matrix (``weights: tensor``); at run time each token's activations get
``s_x = max|x| / 448`` and ``y = (cast(x / s_x) · W_fp8ᵀ) · s_x · s_W``.

On a GPU with FP8 tensor cores (compute capability 8.9 or newer) the product runs
as a real FP8 matrix multiplication (``torch._scaled_mm``); elsewhere it is
simulated: the same E4M3-rounded operands multiplied in float32, so the CPU eval
scores exactly the values an FP8 kernel multiplies (the accumulation order aside).
The stage that makes these layers: ``lmpress.quantize.fp8``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lmpress.errors import LmpressInputError
from lmpress.weights.scheme import QuantScheme

FP8_MAX = 448.0
Strategy = Literal["channel", "tensor"]


def float8_dtype() -> torch.dtype | None:
    """torch's E4M3 dtype, or None when the installed torch has no float8 dtypes."""
    return getattr(torch, "float8_e4m3fn", None)


def require_float8(where: str) -> torch.dtype:
    dtype = float8_dtype()
    if dtype is None:
        raise LmpressInputError(
            f"{where}: the installed torch {torch.__version__} has no float8 dtypes (torch.float8_e4m3fn); "
            "FP8 needs torch 2.1 or newer"
        )
    return dtype


def quantize_fp8(w: torch.Tensor, strategy: Strategy) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_fp8, s_W)`` of a ``(out, in)`` weight: E4M3 codes and float32 scales, ``(out, 1)`` or ``(1,)``."""
    dtype = require_float8("fp8")
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    divisor = scale if strategy == "channel" else scale[0]
    return (w / divisor).clamp(-FP8_MAX, FP8_MAX).to(dtype), scale


def round_to_e4m3_(x: torch.Tensor) -> torch.Tensor:
    """Round float ``x`` (already divided by its scale) in place to the nearest finite E4M3 value."""
    dtype = require_float8("fp8")
    return x.clamp_(-FP8_MAX, FP8_MAX).copy_(x.to(dtype))


def fp8_channel_qparams(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale ``max|w_row| / 448`` and zero 0 of each row of ``w``: the E4M3 counterpart of ``compute_qparams``."""
    scale = w.float().abs().amax(dim=-1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, torch.zeros_like(scale)


def fake_quantize_fp8(w: torch.Tensor) -> torch.Tensor:
    """What E4M3 per-channel quantization leaves of a ``(out, in)`` weight, in its dtype (simulation, searches)."""
    codes, scale = quantize_fp8(w, "channel")
    return (codes.float() * scale).to(w.dtype)


def fake_quantize_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """What per-token E4M3 quantization leaves of ``x``, in ``x``'s dtype."""
    codes, scale = quantize_fp8_per_token(x)
    return (codes.float() * scale).to(x.dtype)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes of each row of ``x`` with ``s_x = max|x_row| / 448``; the scales have shape ``(..., 1)``."""
    dtype = require_float8("fp8")
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype), scale


FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper and newer


def real_fp8_matmul_available(device: torch.device) -> bool:
    """Whether ``device`` has FP8 tensor cores (CUDA compute capability 8.9+: Ada, Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def require_fp8_kernels(model: nn.Module, device: torch.device, source: str) -> None:
    """Refuse to compute ``model`` (read from ``source``) on a CUDA GPU without FP8 tensor cores when it has FP8
    layers (an input error, before any work)."""
    from lmpress.placement import require_capability

    if device.type == "cuda" and any(is_float8(t.dtype) for t in model.buffers()):
        require_capability(device, FP8_CAPABILITY, f"{source} (FP8 layers)")


def is_float8(dtype: torch.dtype) -> bool:
    return "float8" in str(dtype)


@dataclass
class Fp8Weight:
    """One linear's FP8 weight as a reader returns it (the counterpart of ``QuantizedWeight``)."""

    qweight: torch.Tensor  # float8_e4m3fn (out, in)
    scales: torch.Tensor  # float32 (out, 1) or (1,)
    strategy: Strategy
    g_idx: None = None

    @property
    def scheme(self) -> QuantScheme:
        return QuantScheme(8, -1, True, "fp8")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.scales if self.strategy == "channel" else self.scales[0]
        return (self.qweight.float() * scale).to(dtype)


class Fp8Linear(nn.Module):
    """``y = Q(x) Q(W)ᵀ + b`` with E4M3 weights (stored) and per-token E4M3 activations (computed per call).

    Its buffers are named as compressed-tensors ``float-quantized`` checkpoints name them
    (``weight``, ``weight_scale``).
    """

    def __init__(self, in_features: int, out_features: int, strategy: Strategy = "channel", bias: bool = False):
        super().__init__()
        dtype = require_float8("fp8")
        self.in_features, self.out_features, self.strategy = in_features, out_features, strategy
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=dtype))
        self.register_buffer("weight_scale", torch.ones(out_features, 1) if strategy == "channel" else torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_weight(cls, fp8: Fp8Weight, bias: torch.Tensor | None = None) -> Fp8Linear:
        out_features, in_features = fp8.qweight.shape
        module = cls(in_features, out_features, fp8.strategy, bias=bias is not None)
        module.weight.copy_(fp8.qweight)
        module.weight_scale.copy_(fp8.scales)
        if bias is not None:
            module.bias = nn.Parameter(bias.detach().clone().float(), requires_grad=False)
        return module.to(fp8.qweight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, strategy: Strategy) -> Fp8Linear:
        qweight, scales = quantize_fp8(linear.weight.data, strategy)
        bias = None if linear.bias is None else linear.bias.data
        return cls.from_weight(Fp8Weight(qweight, scales, strategy), bias)

    def unpack(self) -> Fp8Weight:
        return Fp8Weight(self.weight.clone(), self.weight_scale.clone(), self.strategy)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.unpack().dequantize(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, E4M3 {self.strategy} weights"

    def _apply(self, fn, recurse=True):
        # model.to(dtype) would cast the E4M3 codes and their scales; only their device follows the module
        weight, scale = self.weight, self.weight_scale
        result = super()._apply(fn, recurse)
        self.weight = weight.to(device=self.weight.device)
        self.weight_scale = scale.to(device=self.weight.device)
        return result

    def multiplies_in_fp8(self, device: torch.device) -> bool:
        return real_fp8_matmul_available(device)

    def simulated_weight(self) -> torch.Tensor:
        """The E4M3 weight values in float32, transposed, for the product where no FP8 matmul runs: converted at
        each call (a kept copy would hold 4 bytes per weight beside the 1-byte codes; the runtime's
        ``kernels.fp8.Fp8SimulatedLinear`` keeps one, for decoding)."""
        return self.weight.float().t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        codes, x_scale = quantize_fp8_per_token(flat)
        w_scale = self.weight_scale.float().reshape(1, -1) if self.strategy == "channel" else self.weight_scale
        if self.multiplies_in_fp8(x.device):
            y = torch._scaled_mm(
                codes,
                self.weight.t(),
                scale_a=x_scale,
                scale_b=w_scale.expand(1, self.out_features).contiguous(),
                out_dtype=torch.float32,
            )
        else:
            y = (codes.float() @ self.simulated_weight()).mul_(x_scale).mul_(w_scale)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def fp8_layers(model: nn.Module) -> dict[str, Fp8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
