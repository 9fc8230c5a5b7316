"""A linear layer that holds its weight packed on the integer grid.

``QuantizedLinear`` keeps the codes bit-packed along the input axis (the
compressed-tensors ``weight_packed`` layout, see ``pack.py``), per-group scales and
integer zeros, the act-order ``g_idx`` and the float bias. Its forward either
dequantizes (reference path: exactly the values ``QuantizedWeight.dequantize``
gives) or, on CPU, runs torch's packed kernels where the layout allows:

- 4 bits, groups of 32/64/128/256 columns (or any multiple of 32, per-channel
  included, by repeating scales), out_features divisible by 16:
  ``_weight_int4pack_mm_for_cpu``, which computes ``w = (q - 8) * scale + offset``
  per group, so ``offset = (8 - zero) * scale`` gives ``(q - zero) * scale``.
  Act-order layers run it on the input columns sorted by group.
- 8 bits, one group per row: ``_weight_int8pack_mm`` on ``q - 128`` (int8) with the
  row scales; a zero other than 128 adds ``sum(x) * (128 - zero) * scale``.

Measured on torch 2.13 (one thread, 1536x576): both kernels are vectorized for
bfloat16 activations only (about 0.03 ms for one row against 3-6 ms for
dequantize + matmul, and still ahead up to ~128 rows); with float32 or float16
activations they fall back to a scalar loop no faster than the reference path.
So ``kernel="auto"`` (the default) runs them for bfloat16 inputs of at most
``KERNEL_MAX_ROWS`` rows; ``kernel="bf16"`` also casts float32/float16 inputs to
bfloat16 for them (fast CPU decoding of a float32 model, ~50 dB SQNR against the
reference); ``kernel="reference"``, other inputs and inputs that need gradients
take the reference path.

A layer whose scheme has ``activations: "int8"`` (W8A8, from SmoothQuant) always
runs its int8 execution (``int8_linear.py``): activations quantized per token,
``torch._int_mm`` on CPU and CUDA; ``kernel="reference"`` simulates the same
function in float (fake-quantized activations times the dequantized weight). Integer weights of fewer bits
or in groups with int8 activations (W4A8) always run that simulation.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from lmpress.weights.int8_linear import (
    cpu_w8a8_product,
    fake_quantize_per_token,
    int8_weight,
    w8a8_linear,
    w8a8_output,
)
from lmpress.weights.pack import ct_pack_weight, ct_unpack_weight, packed_length
from lmpress.weights.scheme import QuantizedWeight, QuantScheme, dequantize_int

KernelMode = Literal["auto", "bf16", "reference"]
INT4_GROUP_SIZES = (32, 64, 128, 256)
KERNEL_MAX_ROWS = 128


def trivial_g_idx(g_idx: torch.Tensor | None, in_features: int, scheme: QuantScheme) -> bool:
    """True when ``g_idx`` is absent or says what the group size already says (no act-order)."""
    if g_idx is None:
        return True
    expected = torch.arange(in_features, device=g_idx.device) // scheme.group_width(in_features)
    return bool(torch.equal(g_idx.long(), expected))


class QuantizedLinear(nn.Module):
    """``y = x @ W_hat.T + b`` with ``W_hat`` stored as packed integer codes, scales and zeros."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: QuantScheme,
        bias: bool = False,
        scale_dtype: torch.dtype = torch.float32,
        act_order: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not scheme.fits(in_features):
            raise ValueError(scheme.misfit(in_features))
        if scheme.activations not in (None, "int8"):
            raise ValueError(f"QuantizedLinear runs int8 or float activations, not {scheme.activations}")
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = scheme
        self.kernel: KernelMode = "auto"
        n_groups = in_features // scheme.group_width(in_features)
        words = packed_length(in_features, scheme.bits)
        self.register_buffer("qweight", torch.zeros(out_features, words, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.ones(out_features, n_groups, dtype=scale_dtype, device=device))
        self.register_buffer("zeros", torch.zeros(out_features, n_groups, dtype=torch.uint8, device=device))
        g_idx = torch.zeros(in_features, dtype=torch.int32, device=device) if act_order else None
        self.register_buffer("g_idx", g_idx)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self._kernel_cache: tuple | None = None

    @classmethod
    def from_quantized_weight(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> QuantizedLinear:
        out_features, in_features = qw.qweight.shape
        if qw.zeros.numel() and not (0 <= float(qw.zeros.min()) and float(qw.zeros.max()) <= 255):
            raise ValueError(f"zero points must lie in [0, 255], got [{qw.zeros.min()}, {qw.zeros.max()}]")
        act_order = not trivial_g_idx(qw.g_idx, in_features, qw.scheme)
        module = cls(
            in_features,
            out_features,
            qw.scheme,
            bias=bias is not None,
            scale_dtype=qw.scales.dtype,
            act_order=act_order,
            device=qw.qweight.device,
        )
        module.qweight.copy_(ct_pack_weight(qw.qweight, qw.scheme.bits) if qw.packed is None else qw.packed)
        module.scales.copy_(qw.scales)
        module.zeros.copy_(qw.zeros.round().to(torch.uint8))
        if act_order:
            module.g_idx.copy_(qw.g_idx)
        if bias is not None:
            module.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        return module

    def extra_repr(self) -> str:
        act = ", act-order" if self.g_idx is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.describe()}{act}"

    def codes(self) -> torch.Tensor:
        """The integer codes, ``(out, in)`` uint8."""
        return ct_unpack_weight(self.qweight, self.scheme.bits, self.in_features)

    def unpack(self) -> QuantizedWeight:
        return QuantizedWeight(
            qweight=self.codes(),
            scales=self.scales.clone(),
            zeros=self.zeros.float(),
            scheme=self.scheme,
            g_idx=None if self.g_idx is None else self.g_idx.clone(),
        )

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(q - zero) * scale``, bit for bit what ``self.unpack().dequantize(dtype)`` gives."""
        if self.g_idx is not None:
            return self.unpack().dequantize(dtype)
        n_groups = self.scales.shape[1]
        codes = self.codes().view(self.out_features, n_groups, -1)
        weight = dequantize_int(codes, self.scales[..., None], self.zeros[..., None].float())
        return weight.reshape(self.out_features, self.in_features).to(dtype)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) / .half() would round the scales; they are part of the quantized
        # weight, so only their device follows the module (the bias follows dtype casts).
        scales = self.scales
        self._kernel_cache = None
        result = super()._apply(fn, recurse)
        self.scales = scales.to(device=self.scales.device)
        return result

    @property
    def int8_matmul_holds(self) -> bool:
        return self.scheme.int8_matmul_holds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_matmul_holds:
            return self._w8a8_forward(x)
        if self.scheme.activations is not None:  # W4A8: per-token int8 activations times the dequantized weight
            return nn.functional.linear(fake_quantize_per_token(x), self.dequantized_weight(x.dtype), self._bias_as(x))
        if self._kernel_applies(x):
            y = self._kernel_forward(x)
            if y is not None:
                return y
        return nn.functional.linear(x, self.dequantized_weight(x.dtype), self._bias_as(x))

    def _w8a8_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "reference":
            weight = self.dequantized_weight(x.dtype)
            return nn.functional.linear(fake_quantize_per_token(x), weight, self._bias_as(x))
        cache = self._kernel_cache
        if cache is None or cache[-1] != x.device:
            cache = self._kernel_cache = self._prepare_w8a8(x.device)
        if cache[0] == "w8a8-cpu":
            return w8a8_output(cache[1](x.reshape(-1, self.in_features).float().contiguous()), x, self.bias)
        return w8a8_linear(x, cache[1], cache[2], self.bias)

    def _prepare_w8a8(self, device: torch.device) -> tuple:
        """On the CPU, a registered kernel that gives ``torch._int_mm``'s bits (lmpress's int8 kernel, once the runtime
        is imported, as ``lmpress run`` and ``lmpress eval`` do), where ``_int_mm`` on an AVX2-only CPU took 2 minutes
        a 2,048-token window of SmolLM2; else the int8 weight transposed for ``_int_mm``. Either holds a byte a
        weight."""
        product = cpu_w8a8_product(self.codes(), self.scales.detach()) if device.type == "cpu" else None
        if product is not None:
            return ("w8a8-cpu", product, device)
        weight_t = int8_weight(self.codes()).t().contiguous().to(device)
        return ("w8a8", weight_t, self.scales[:, 0].float().to(device), device)

    def _kernel_applies(self, x: torch.Tensor) -> bool:
        if self.kernel == "reference" or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
            return False
        if x.numel() > KERNEL_MAX_ROWS * self.in_features:
            return False
        return x.dtype == torch.bfloat16 or (self.kernel == "bf16" and x.dtype in (torch.float32, torch.float16))

    def _bias_as(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.to(x.dtype)

    # CPU kernels ------------------------------------------------------------------------

    def kernel_name(self) -> str:
        """The CPU kernel this layer's layout allows ("int4", "int8"), or "reference" when none does."""
        if self.kernel == "reference":
            return "reference"
        if self.scheme.activations is not None:
            return "w8a8"
        cache = self._prepared()
        return cache[0] if cache is not None else "reference"

    def _prepared(self) -> tuple | None:
        if self._kernel_cache is None:
            self._kernel_cache = self._prepare_kernel() or ("reference",)
        return None if self._kernel_cache[0] == "reference" else self._kernel_cache

    def _prepare_kernel(self) -> tuple | None:
        if self.qweight.device.type != "cpu":
            return None
        bits, width = self.scheme.bits, self.scheme.group_width(self.in_features)
        if bits == 8 and self.scales.shape[1] == 1:
            codes = (self.codes() ^ 0x80).view(torch.int8)  # q - 128 in two's complement, without a wider copy
            scale = self.scales[:, 0].float()
            offset = (128.0 - self.zeros[:, 0].float()) * scale
            has_offset = bool((self.zeros != 128).any())
            bf16 = torch.bfloat16
            return ("int8", codes, scale.to(bf16), offset.to(bf16) if has_offset else None)
        if bits == 4 and self.out_features % 16 == 0 and width % 32 == 0:
            kernel_group = width if width in INT4_GROUP_SIZES else 32
            codes, scales, zeros = self.codes(), self.scales.float(), self.zeros.float()
            perm = None
            if self.g_idx is not None:
                counts = torch.bincount(self.g_idx.long(), minlength=scales.shape[1])
                if not bool((counts == width).all()):
                    return None
                perm = torch.argsort(self.g_idx.long(), stable=True)
                codes = codes[:, perm]
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
            return ("int4", packed, kernel_group, int4pack_scale_and_zero(scales, zeros, width // kernel_group), perm)
        return None

    def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        cache = self._prepared()
        if cache is None:
            return None
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if cache[0] == "int8":
            _, weight, scale, offset = cache
            y = torch.ops.aten._weight_int8pack_mm(flat.contiguous(), weight, scale)
            if offset is not None:
                y = y + flat.sum(dim=-1, keepdim=True) * offset
        else:
            _, packed, group, scale_offset, perm = cache
            if perm is not None:
                flat = flat[:, perm]
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), packed, group, scale_offset)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


def int4pack_scale_and_zero(scales: torch.Tensor, zeros: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """lmpress's ``(q - zero) * scale`` as torch's int4 kernels take it: bf16 ``(groups, out, 2)`` of
    ``[scale, (8 - zero) * scale]``.

    ``_weight_int4pack_mm`` (CUDA tinygemm, aten/src/ATen/native/cuda/int4mm.cu) and
    ``_weight_int4pack_mm_for_cpu`` both compute ``w = (q - 8) * scale + offset`` per group from a
    ``(K / group, N, 2)`` tensor, so ``offset = (8 - zero) * scale``. ``scales`` and ``zeros`` are
    ``(out, groups)``; ``repeat`` splits each group into that many kernel groups (a 256-wide group as two of
    128, a per-channel row as K / 128), repeating its scale and offset.
    """
    scales = scales.float().repeat_interleave(repeat, dim=1)
    offsets = (8.0 - zeros.float().repeat_interleave(repeat, dim=1)) * scales
    return torch.stack([scales.t(), offsets.t()], dim=-1).to(torch.bfloat16).contiguous()


def quantized_linear_from(linear: nn.Linear, qw: QuantizedWeight) -> QuantizedLinear:
    """A QuantizedLinear standing in for ``linear`` (its bias kept) with weight ``qw``."""
    if tuple(qw.qweight.shape) != (linear.out_features, linear.in_features):
        raise ValueError(
            f"quantized weight shape {tuple(qw.qweight.shape)} does not match the linear layer "
            f"({linear.out_features}, {linear.in_features})"
        )
    bias = None if linear.bias is None else linear.bias.data
    module = QuantizedLinear.from_quantized_weight(qw, bias)
    return module.to(linear.weight.device)
