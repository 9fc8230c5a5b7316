"""4-bit floats: NVFP4 and MXFP4 weights (and activations), the grids current GPUs multiply natively.

Both store E2M1 values (1 sign, 2 exponent, 1 mantissa bit: 0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6) in blocks
along the input axis, each block with its own scale (OCP Microscaling spec v1.0; NVIDIA's NVFP4):

- **NVFP4**: blocks of 16, an E4M3 scale per block and one float32 ``global_scale`` per tensor;
  ``w = e2m1 * (scale_e4m3 / global_scale)``, ``global_scale = 448 * 6 / max|W|`` so the block scales use
  E4M3's whole range.
- **MXFP4**: blocks of 32, a power-of-two scale per block stored as E8M0 (a biased exponent byte):
  ``w = e2m1 * 2**(e - 127)``.

The encodings are compressed-tensors' (``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``), which vLLM reads:
a code is ``sign << 3 | index`` of the magnitude in ``E2M1_VALUES``, two codes a byte, the lower column in the
low nibble; zero is always code 0 (what their packer writes for the zeros of a dequantized weight). Rounding to
E2M1 is to the nearest value, ties to the even mantissa (their ``cast_to_fp4`` thresholds).

Activations (``activations: "fp4"``, W4A4) are quantized per call, per block of 16 (NVFP4: E4M3 scales under a
static per-layer ``input_global_scale`` from calibration) or 32 (MXFP4: E8M0 scales), as the presets define.

Tensors in, tensors out: no calibration code (the contract quantize, export and runtime share).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lmpress.weights.float8 import FP8_MAX, require_float8
from lmpress.weights.scheme import FP4_GROUP_SIZES, QuantScheme

Fp4Format = Literal["nvfp4", "mxfp4"]
FP4_BLOCK = FP4_GROUP_SIZES  # block size of each format
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_MAX_CODE = 0x7E  # 448; 0x7F is E4M3's NaN
E8M0_BIAS = 127
E8M0_NAN = 255
# MX blocks scale so that the block's largest power of two lands on E2M1's (2**2 = 4): OCP MX spec §6.3.
_MX_ELEMENT_EMAX = 2
# NVFP4 block-scale candidates: E4M3 values this many steps (1/8 of an octave each) from the one that maps the block's
# max to 6: from about 0.7x to 1.1x of it.
_NVFP4_STEPS = (-4, -3, -2, -1, 1)


def fp4_format_of(scheme: QuantScheme) -> Fp4Format:
    if scheme.fp4 is None:
        raise ValueError(f"{scheme.describe()} is not an FP4 scheme")
    return scheme.fp4  # type: ignore[return-value]


# E2M1 ------------------------------------------------------------------------------------------


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """float32 value of each of the 16 codes (codes 8-15 are the negatives of 0-7; code 8, never written, is -0.0)."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def e2m1_pair_table(device: torch.device | str | None = None) -> torch.Tensor:
    """``(256, 2)`` float32: the values of a packed byte's two codes, low nibble first (``pack_fp4``'s order)."""
    table = e2m1_table(device)
    return torch.stack([table.repeat(16), table.repeat_interleave(16)], dim=-1)


def _e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """The nearest E2M1 magnitude of ``a >= 0`` (float32): E2M1's steps are 0.5 below 2, 1 below 4 and 2 up to 6,
    and ``torch.round`` rounds half to even, which on each step's grid is the even mantissa."""
    return torch.where(
        a < 2, torch.round(a * 2) * 0.5, torch.where(a < 4, torch.round(a), torch.round(a * 0.5) * 2)
    ).clamp_(max=E2M1_MAX)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """uint8 code (``sign << 3 | magnitude index``) of the nearest E2M1 value of each element of ``x`` (already
    divided by its scale; clamped to ±6)."""
    x = x.float()
    m = _e2m1_magnitude(x.abs())
    index = torch.where(m <= 2, m * 2, torch.where(m <= 4, m + 2, 7.0)).to(torch.uint8)  # 3 -> 5, 4 -> 6, 6 -> 7
    return index | (((x < 0) & (index > 0)).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes."""
    return torch.take(e2m1_table(codes.device), codes.long())  # a 16-entry lookup: take, not advanced indexing


def fake_quantize_e2m1(x: torch.Tensor) -> torch.Tensor:
    """The nearest E2M1 value of each element (float32)."""
    x = x.float()
    return torch.copysign(_e2m1_magnitude(x.abs()), x)


# Block scales ---------------------------------------------------------------------------------


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to the nearest finite E4M3 value (saturating at ±448)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(require_float8("nvfp4")).float()


def encode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents of power-of-two scales (``2**(e - 127)``)."""
    exponent = torch.log2(scale.float()).round().to(torch.int32) + E8M0_BIAS
    return exponent.clamp(0, E8M0_NAN - 1).to(torch.uint8)


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """float32 scales ``2**(e - 127)`` of E8M0 bytes (255, E8M0's NaN, decodes to NaN)."""
    scale = torch.exp2(codes.to(torch.float32) - E8M0_BIAS)
    return torch.where(codes == E8M0_NAN, torch.full_like(scale, float("nan")), scale)


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """``448 * 6 / max|w|`` as float32 ``(1,)`` (1 for an all-zero tensor), as compressed-tensors computes it."""
    amax = w.detach().float().abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    scale = FP8_MAX * E2M1_MAX / amax
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def _blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    if w.shape[-1] % block:
        raise ValueError(f"FP4 blocks of {block} do not divide the last dimension {w.shape[-1]}")
    return w.float().reshape(*w.shape[:-1], w.shape[-1] // block, block)


def _nvfp4_minmax_scales(amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    scale = round_to_e4m3(amax / E2M1_MAX * global_scale)
    # compressed-tensors' observer replaces a zero E4M3 scale by E4M3's eps (0.125)
    return torch.where(scale > 0, scale, torch.full_like(scale, 0.125))


def _mxfp4_minmax_scales(amax: torch.Tensor) -> torch.Tensor:
    """``2**(floor(log2(amax)) - 2)``, the block max's exponent rounded up when its mantissa is 1.75 or more
    (compressed-tensors' ``generate_mx_scales``: a max of 1.75 * 2**e would clip at 6 * 2**(e - 2) by more than
    it gains)."""
    exponent = torch.floor(torch.log2(amax.clamp(min=2.0**-126)))
    exponent = exponent + (amax / torch.exp2(exponent) >= 1.75).float() - _MX_ELEMENT_EMAX
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent))
    return torch.exp2(exponent.clamp(-E8M0_BIAS, E8M0_BIAS))


def _block_error(blocks: torch.Tensor, effective: torch.Tensor) -> torch.Tensor:
    """Σ (w - fake_quant(w))² of each block for scales ``effective`` (broadcast against ``blocks[..., 0]``)."""
    q = fake_quantize_e2m1((blocks / effective[..., None]).clamp_(-E2M1_MAX, E2M1_MAX))
    return (q.mul_(effective[..., None]) - blocks).pow_(2).sum(-1)


def fp4_block_scales(
    blocks: torch.Tensor, fmt: Fp4Format, global_scale: torch.Tensor | None = None, mse: bool = False
) -> torch.Tensor:
    """The stored scale of each block of ``blocks`` ``(..., n_blocks, block)``: E4M3 values (NVFP4, under
    ``global_scale``) or powers of two (MXFP4), as float32 ``(..., n_blocks)``.

    Without ``mse`` the scale maps the block's max to 6 (rounded to the encoding), as compressed-tensors'
    observers do; with ``mse`` each block takes, of the encoding's values near that, the one with the least
    squared error (NVFP4: the E4M3 values from about 0.7x to 1.1x; MXFP4: the power of two below and above too).
    """
    amax = blocks.abs().amax(-1)
    if fmt == "nvfp4":
        if global_scale is None:
            raise ValueError("NVFP4 block scales need the tensor's global scale")
        gs = global_scale.float().to(blocks.device)
        best = _nvfp4_minmax_scales(amax, gs)
        if not mse:
            return best
        # a positive E4M3 value's bits count up with it: the neighbours of ``best`` are its code plus or minus k
        codes = best.to(require_float8("nvfp4")).view(torch.uint8).to(torch.int16)
        candidates = [
            (codes + k).clamp(1, E4M3_MAX_CODE).to(torch.uint8).view(require_float8("nvfp4")).float()
            for k in _NVFP4_STEPS
        ]
    else:
        best = _mxfp4_minmax_scales(amax)
        if not mse:
            return best
        candidates = [best * 0.5, best * 2.0]
    gs = global_scale.float().to(blocks.device) if fmt == "nvfp4" else torch.ones(1, device=blocks.device)
    best_error = _block_error(blocks, best / gs)
    for candidate in candidates:
        candidate = torch.where(candidate > 0, candidate, best)
        error = _block_error(blocks, candidate / gs)
        better = error < best_error
        best = torch.where(better, candidate, best)
        best_error = torch.where(better, error, best_error)
    return best


# The packed weight --------------------------------------------------------------------------------


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``(rows, cols)`` codes -> uint8 ``(rows, cols / 2)``, column ``2j`` in the low nibble of byte ``j``."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even number of columns, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_fp4``: uint8 codes ``(rows, 2 * cols)``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed FP4 weights are uint8, got {packed.dtype}")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


@dataclass
class Fp4Weight:
    """One linear layer's weight in FP4: the counterpart of ``QuantizedWeight``.

    ``codes``: uint8 ``(out, in)`` E2M1 codes; ``scales``: float32 ``(out, in / block)``, each block's stored
    scale as a value (an E4M3 value for NVFP4, a power of two for MXFP4); ``global_scale``: NVFP4's float32
    ``(1,)`` (None for MXFP4); ``input_global_scale``: NVFP4 W4A4's static activation scale (None otherwise).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    scheme: QuantScheme
    global_scale: torch.Tensor | None = None
    input_global_scale: torch.Tensor | None = None
    g_idx: None = None

    def effective_scales(self) -> torch.Tensor:
        """The per-block multiplier of the E2M1 values (``scale / global_scale`` for NVFP4)."""
        return self.scales if self.global_scale is None else self.scales / self.global_scale.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out_features, in_features = self.codes.shape
        blocks = e2m1_values(self.codes).reshape(out_features, self.scales.shape[1], -1)
        return (blocks * self.effective_scales()[..., None]).reshape(out_features, in_features).to(dtype)


def quantize_weight_fp4(w: torch.Tensor, scheme: QuantScheme, mse: bool = False) -> Fp4Weight:
    """Round-to-nearest FP4 of a ``(out, in)`` weight: block scales by min/max or by the MSE search
    (``fp4_block_scales``), then each value to its nearest E2M1 code."""
    fmt = fp4_format_of(scheme)
    out_features, in_features = w.shape
    if not scheme.fits(in_features):
        raise ValueError(scheme.misfit(in_features))
    blocks = _blocks(w, FP4_BLOCK[fmt])
    global_scale = nvfp4_global_scale(w) if fmt == "nvfp4" else None
    scales = fp4_block_scales(blocks, fmt, global_scale, mse=mse)
    effective = scales if global_scale is None else scales / global_scale
    codes = round_to_e2m1((blocks / effective[..., None]).clamp(-E2M1_MAX, E2M1_MAX))
    return Fp4Weight(codes.reshape(out_features, in_features), scales, scheme, global_scale)


# Activations -------------------------------------------------------------------------------------


def fake_quantize_fp4_activations(
    x: torch.Tensor, fmt: Fp4Format, input_global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """What per-block FP4 quantization (blocks of the last dimension, min/max scales computed per call) leaves
    of ``x``, in ``x``'s dtype. NVFP4 uses the layer's static ``input_global_scale`` (per call from ``x`` when
    None)."""
    blocks = _blocks(x, FP4_BLOCK[fmt])
    gs = None
    if fmt == "nvfp4":
        gs = nvfp4_global_scale(x) if input_global_scale is None else input_global_scale.float().to(x.device)
    effective = activation_block_scales(blocks.abs().amax(-1), fmt, gs)
    q = fake_quantize_e2m1((blocks / effective[..., None]).clamp(-E2M1_MAX, E2M1_MAX)) * effective[..., None]
    return q.reshape(x.shape).to(x.dtype)


def activation_block_scales(
    amax: torch.Tensor, fmt: Fp4Format, global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The effective scale (stored scale over the global one) of each activation block whose largest magnitude is
    ``amax``: min/max scales, as the presets quantize activations per call."""
    if fmt == "nvfp4":
        if global_scale is None:
            raise ValueError("NVFP4 activation scales need the global scale")
        return _nvfp4_minmax_scales(amax, global_scale) / global_scale
    return _mxfp4_minmax_scales(amax)


# The layer ----------------------------------------------------------------------------------------


class Fp4Linear(nn.Module):
    """``y = A(x) Wᵀ + b`` with ``W`` stored as packed E2M1 codes and block scales, in compressed-tensors'
    names and encodings (``weight_packed``, ``weight_scale`` as E4M3 or E8M0 bytes, ``weight_global_scale``,
    ``input_global_scale``); ``A`` is FP4 activation quantization for W4A4 schemes, the identity for A16."""

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool = False) -> None:
        super().__init__()
        fmt = fp4_format_of(scheme)
        if not scheme.fits(in_features):
            raise ValueError(scheme.misfit(in_features))
        self.in_features, self.out_features, self.scheme, self.fmt = in_features, out_features, scheme, fmt
        n_blocks = in_features // FP4_BLOCK[fmt]
        scale_dtype = require_float8("nvfp4") if fmt == "nvfp4" else torch.uint8
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(out_features, n_blocks, dtype=scale_dtype))
        nv = fmt == "nvfp4"
        self.register_buffer("weight_global_scale", torch.ones(1) if nv else None)
        self.register_buffer("input_global_scale", torch.ones(1) if nv and scheme.activations == "fp4" else None)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_weight(cls, fp4: Fp4Weight, bias: torch.Tensor | None = None) -> Fp4Linear:
        out_features, in_features = fp4.codes.shape
        module = cls(in_features, out_features, fp4.scheme, bias=bias is not None)
        module.weight_packed.copy_(pack_fp4(fp4.codes))
        if module.fmt == "nvfp4":
            module.weight_scale.copy_(fp4.scales.to(module.weight_scale.dtype))
            module.weight_global_scale.copy_(fp4.global_scale)
        else:
            module.weight_scale.copy_(encode_e8m0(fp4.scales))
        if module.input_global_scale is not None:
            if fp4.input_global_scale is None:
                raise ValueError(f"{fp4.scheme.describe()} needs a calibrated input_global_scale")
            module.input_global_scale.copy_(fp4.input_global_scale)
        if bias is not None:
            module.bias = nn.Parameter(bias.detach().clone().float(), requires_grad=False)
        return module.to(fp4.codes.device)

    def block_scales(self) -> torch.Tensor:
        """Each block's stored scale as a float32 value."""
        if self.fmt == "nvfp4":
            return self.weight_scale.float()
        return decode_e8m0(self.weight_scale)

    def unpack(self) -> Fp4Weight:
        nv = self.fmt == "nvfp4"
        return Fp4Weight(
            codes=unpack_fp4(self.weight_packed),
            scales=self.block_scales(),
            scheme=self.scheme,
            global_scale=self.weight_global_scale.clone() if nv else None,
            input_global_scale=None if self.input_global_scale is None else self.input_global_scale.clone(),
        )

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``unpack().dequantize(dtype)`` straight from the packed bytes: one lookup per byte gives both of its
        values, with no int8 codes in between (the layer dequantizes at each call)."""
        scales = self.block_scales()
        if self.fmt == "nvfp4":
            scales = scales / self.weight_global_scale.float()
        pairs = e2m1_pair_table(self.weight_packed.device)
        values = nn.functional.embedding(self.weight_packed.long(), pairs).reshape(
            self.out_features, scales.shape[1], -1
        )
        return (values * scales[..., None]).reshape(self.out_features, self.in_features).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.describe()}"

    def _apply(self, fn, recurse=True):
        # model.to(dtype) would round the codes' scales; like QuantizedLinear's, they only follow the device
        kept = {name: getattr(self, name) for name in ("weight_scale", "weight_global_scale", "input_global_scale")}
        result = super()._apply(fn, recurse)
        for name, tensor in kept.items():
            if tensor is not None:
                setattr(self, name, tensor.to(device=self.weight_packed.device))
        return result

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.activations == "fp4":
            x = fake_quantize_fp4_activations(x, self.fmt, self.input_global_scale)
        # dequantized at each call, as QuantizedLinear's: a kept float copy would hold the model's float weights
        # again beside the codes
        weight = self.dequantized_weight(x.dtype).to(x.device)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, weight, bias)


def fp4_layers(model: nn.Module) -> dict[str, Fp4Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp4Linear)}
