"""The integer grid every lmpress weight quantizer shares.

Convention (the one GPTQ checkpoints, vLLM and compressed-tensors use):
    q     = clamp(round(w / scale) + zero, 0, 2**bits - 1)
    w_hat = (q - zero) * scale
Symmetric schemes fix ``zero = 2**(bits-1)`` and ``scale = 2 * max|w| / (2**bits - 1)``;
asymmetric schemes take ``scale = (max - min) / (2**bits - 1)`` and ``zero = round(-min / scale)``.
Scales and zeros are per output row and per group of ``group_size`` input columns
(``group_size == -1``: one group spanning the whole row). With ``k_quant_scales`` (W4 g32
symmetric only) the group scales themselves sit on llama.cpp's k-quant grid, an integer 1..63
times one float16 per 256 columns of a row (``kquant.py``), so GGUF can store them as ``Q4_K``.

This module is the contract between quantize, export and runtime: tensors in,
tensors out, no calibration code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmpress.weights.kquant import GROUP, SUPER_BLOCK, live_groups, snap_to_kquant_grid

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
# Activation schemes a quantized linear can run with (None: weight-only, float activations).
# "int8": dynamic symmetric per-token int8 activations, int8 matrix multiplication (``int8_linear.py``).
# "fp8": dynamic per-token E4M3 activations with E4M3 weights (``fp8.py``, its own module ``Fp8Linear``).
# "fp4": per-block FP4 activations with FP4 weights of the same format (``fp4.py``, ``Fp4Linear``).
ACTIVATION_SCHEMES = ("int8", "fp8", "fp4")
# 4-bit float weight grids (``fp4.py``) and the block (group) size each format defines.
FP4_GROUP_SIZES = {"nvfp4": 16, "mxfp4": 32}


@dataclass(frozen=True)
class QuantScheme:
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    activations: str | None = None  # one of ACTIVATION_SCHEMES, or None for weight-only quantization
    k_quant_scales: bool = False  # group scales on llama.cpp's k-quant grid (Q4_K): W4 g32 sym only
    fp4: str | None = None  # "nvfp4" or "mxfp4": E2M1 values with block scales (fp4.py) instead of integers

    def __post_init__(self) -> None:
        if self.fp4 is not None:
            self._check_fp4()
        elif self.activations == "fp4":
            raise ValueError("fp4 activations need FP4 weights (fp4: nvfp4 or mxfp4)")
        if self.k_quant_scales and (self.bits, self.group_size, self.symmetric) != (4, GROUP, True):
            raise ValueError(
                f"k_quant_scales (Q4_K's 6-bit group scales per {SUPER_BLOCK} columns) need bits: 4, "
                f"group_size: {GROUP}, symmetric: true; got bits: {self.bits}, group_size: {self.group_size}, "
                f"symmetric: {str(self.symmetric).lower()}"
            )

    def _check_fp4(self) -> None:
        if self.fp4 not in FP4_GROUP_SIZES:
            raise ValueError(f"unknown FP4 format {self.fp4!r}; known: {sorted(FP4_GROUP_SIZES)}")
        block = FP4_GROUP_SIZES[self.fp4]
        if self.group_size != block:
            raise ValueError(
                f"{self.fp4} defines blocks of {block} (group_size: {block}), not group_size {self.group_size}"
            )
        if self.bits != 4 or not self.symmetric or self.k_quant_scales:
            raise ValueError(f"{self.fp4} weights are 4-bit, symmetric, without k-quant scales")
        if self.activations not in (None, "fp4"):
            raise ValueError(f"{self.fp4} weights run with fp4 or float activations, not {self.activations}")

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    @property
    def int8_matmul_holds(self) -> bool:
        """Whether int8 activations meet int8 weights in one int8 matmul (W8A8: 8-bit symmetric per-channel
        weights); other integer weights with int8 activations (W4A8) run dequantized."""
        return self.activations == "int8" and (self.bits, self.group_size, self.symmetric) == (8, -1, True)

    def group_width(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def misfit(self, in_features: int) -> str | None:
        """Why a layer with ``in_features`` input columns cannot take this scheme, or None."""
        if self.group_size != -1 and in_features % self.group_size:
            return f"group size {self.group_size} does not divide in_features {in_features}"
        if self.k_quant_scales and in_features % SUPER_BLOCK:
            return f"k-quant scales need in_features divisible by {SUPER_BLOCK}, got {in_features}"
        return None

    def fits(self, in_features: int) -> bool:
        return self.misfit(in_features) is None

    def describe(self) -> str:
        if self.fp4 is not None:
            return f"{self.fp4.upper()}{'' if self.activations == 'fp4' else 'A16'} (E2M1, blocks of {self.group_size})"
        group = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        weights = f"W{self.bits} {group} {'sym' if self.symmetric else 'asym'}"
        if self.k_quant_scales:
            weights += " k-quant scales"
        return weights if self.activations is None else f"{weights}, {self.activations} per-token activations"


def compute_qparams(
    w: torch.Tensor, scheme: QuantScheme, shrink: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero for each row of ``w`` (shape ``(..., width)``, one group per row).

    ``shrink`` narrows the min/max range (clipping search); returns float tensors
    of shape ``w.shape[:-1]``; zeros hold integer values.
    """
    w = w.float()
    maxq = scheme.maxq
    if scheme.symmetric:
        amax = w.abs().amax(dim=-1) * shrink
        scale = 2 * amax / maxq
        zero = torch.full_like(scale, float((maxq + 1) // 2))
    else:
        wmin = (w.amin(dim=-1) * shrink).clamp(max=0)
        wmax = (w.amax(dim=-1) * shrink).clamp(min=0)
        scale = (wmax - wmin) / maxq
        zero = torch.round(-wmin / scale.clamp(min=torch.finfo(torch.float32).tiny)).clamp(0, maxq)
    # An all-zero group would divide by zero; any positive scale reproduces it exactly.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, zero


def quantize_to_int(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Integer codes (as float) of ``w`` on the grid; scale/zero broadcast against ``w``."""
    return torch.clamp(torch.round(w.float() / scale) + zero, 0, maxq)


def straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded`` forward (exactly: ``x − x`` is 0 however far ``x`` has moved from it), the identity backward
    (straight-through; Bengio et al. 2013)."""
    return rounded.detach() + (x - x.detach())


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """⌊x⌉ forward, identity gradient: for weights that learn their rounding."""
    return straight_through(x, torch.round(x))


def dequantize_int(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (q.float() - zero) * scale


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Quantize then dequantize: the float values the quantized weight stands for."""
    return dequantize_int(quantize_to_int(w, scale, zero, maxq), scale, zero)


@dataclass
class QuantizedWeight:
    """One linear layer's weight on the integer grid, unpacked.

    ``qweight``: uint8 ``(out, in)``; ``scales``/``zeros``: ``(out, n_groups)``;
    ``g_idx``: int32 ``(in,)`` group of each input column (act-order), or None when
    column ``j`` is in group ``j // group_size``. ``packed``: ``qweight`` as the compressed-tensors int32
    words it was read from, if it was (a ``QuantizedLinear`` built from it copies them instead of packing again).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    scheme: QuantScheme
    g_idx: torch.Tensor | None = None
    packed: torch.Tensor | None = None

    def column_groups(self) -> torch.Tensor:
        in_features = self.qweight.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        width = self.scheme.group_width(in_features)
        return torch.arange(in_features) // width

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        groups = self.column_groups()
        scale = self.scales[:, groups]
        zero = self.zeros[:, groups]
        return dequantize_int(self.qweight, scale, zero).to(dtype)


def quantize_weight_rtn(
    w: torch.Tensor,
    scheme: QuantScheme,
    qparams: Callable[[torch.Tensor, QuantScheme], tuple[torch.Tensor, torch.Tensor]] = compute_qparams,
) -> QuantizedWeight:
    """Round-to-nearest quantization of a ``(out, in)`` weight with min/max scales (on the k-quant grid
    when the scheme asks for ``k_quant_scales``), or the scales ``qparams`` picks for each group (a search)."""
    out_features, in_features = w.shape
    if not scheme.fits(in_features):
        raise ValueError(scheme.misfit(in_features))
    width = scheme.group_width(in_features)
    grouped = w.float().reshape(out_features, in_features // width, width)
    scale, zero = qparams(grouped, scheme)
    if scheme.k_quant_scales:
        scale = snap_to_kquant_grid(scale, live_groups(grouped))
    q = quantize_to_int(grouped, scale[..., None], zero[..., None], scheme.maxq)
    return QuantizedWeight(
        qweight=q.reshape(out_features, in_features).to(torch.uint8),
        scales=scale,
        zeros=zero,
        scheme=scheme,
    )
