"""W4 layers on torch's own int4 kernels: ``_weight_int4pack_mm`` (CUDA tinygemm) and its CPU twin.

The codes are repacked once: at build time into nibble pairs ``(N, K / 2)`` uint8 (the even
column in the high nibble, as torch's test_linalg packs them), and, when the module moves to a
GPU, by ``_convert_weight_to_int4pack(.., inner_k_tiles)`` into the tensor-core layout
``(N / 8, K / (16 * inner_k_tiles), 32, inner_k_tiles / 2)`` int32. The scales and zeros fold into
one bf16 ``(K / group, N, 2)`` tensor of ``[scale, (8 - zero) * scale]``
(``qlinear.int4pack_scale_and_zero``; both kernels compute ``(q - 8) * scale + offset``).
Act-order layers keep their codes sorted by group and permute the activations.

tinygemm is a decode kernel: its time grows with the rows (an H200, 28672 x 4096: 39 us for 1-2 rows,
82 us for 8, 16.4 ms for 2048, 26x bf16 cuBLAS; ``bench/results/gpu_visit_h200``). From ``DEQUANT_MIN_ROWS``
rows on (prefill), the layer dequantizes its codes and multiplies with the library's GEMM instead. On a GPU the
codes are kept once, in tinygemm's layout: a prefill reads its nibble pairs back out of it
(``int4pack_layout.unpack_int4_tensor_core``), which the module checks on its own codes when it packs them (where
the check fails it keeps the pairs beside, twice the memory, and says so once).

On the CPU (tests, or a module never moved) the same codes and the same scale-and-zero tensor run
through ``_weight_int4pack_mm_for_cpu``, which is how the conversion is verified without a GPU.
tinygemm's limits (``select._tinygemm_holds``): bf16 activations, N % 8 == 0, K % 32 == 0, groups
of 32-256 columns (wider multiples of 32 repeat their scales), sm80 or newer.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from lmpress.runtime.kernels.int4pack_layout import unpack_int4_tensor_core
from lmpress.runtime.kernels.select import TINYGEMM_GROUPS
from lmpress.weights.qlinear import QuantizedLinear, int4pack_scale_and_zero, trivial_g_idx

# From this many rows on, dequantize + the library's GEMM: at 8 rows tinygemm already runs at only 0.83-1.10x
# the speed of a bf16 GEMM over the whole weight, and its time grows with the rows (an H200's kernel table); 32 is
# an estimate of the crossover with the dequantization's cost added, not yet measured on a GPU.
DEQUANT_MIN_ROWS = 32


def kernel_group(width: int) -> int:
    """The widest group tinygemm holds that divides ``width`` (a layer's group width, a multiple of 32)."""
    for group in TINYGEMM_GROUPS:
        if width % group == 0:
            return group
    raise ValueError(f"tinygemm needs groups of a multiple of 32 columns, got {width}")


def inner_k_tiles(in_features: int) -> int:
    """The most k-tiles of 16 per 16-byte load that divide K (8 for any K % 256 == 0)."""
    for tiles in (8, 4, 2):
        if in_features % (16 * tiles) == 0:
            return tiles
    raise ValueError(f"tinygemm needs in_features a multiple of 32, got {in_features}")


def nibble_pairs(codes: torch.Tensor) -> torch.Tensor:
    """``(N, K)`` 4-bit codes -> ``(N, K / 2)`` uint8, column 2i in the high nibble, 2i + 1 in the low."""
    codes = codes.to(torch.uint8)
    return (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()


def unpaired(pairs: torch.Tensor) -> torch.Tensor:
    """The inverse of ``nibble_pairs``: ``(N, K)`` int32 codes."""
    return torch.stack((pairs >> 4, pairs & 0xF), dim=-1).reshape(pairs.shape[0], -1).to(torch.int32)


class TinyGemmLinear(nn.Module):
    """A 4-bit linear layer run by ``_weight_int4pack_mm`` on CUDA (``_weight_int4pack_mm_for_cpu`` on the CPU)."""

    KERNEL = "tinygemm"
    PREFILL_ONLY = ("pairs",)  # what a decode step does not read (``throughput.weight_bytes``)

    def __init__(
        self,
        pairs: torch.Tensor,
        scale_and_zero: torch.Tensor,
        group: int,
        perm: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = pairs.shape[0], pairs.shape[1] * 2
        self.group, self.inner_k_tiles = group, inner_k_tiles(self.in_features)
        self.register_buffer("pairs", pairs)  # nibble pairs: the same tensor as weight off a GPU, None on one
        self.register_buffer("weight", pairs)  # the tensor-core layout once on a GPU
        self.register_buffer("scale_and_zero", scale_and_zero)
        self.register_buffer("perm", perm)
        self.register_buffer("bias", bias)
        self._cpu_packed: torch.Tensor | None = None

    @property
    def packed_for_gpu(self) -> bool:
        return self.weight.dim() == 4

    def nibble_pairs(self) -> torch.Tensor:
        """The codes as ``(N, K / 2)`` nibble pairs (``nibble_pairs``), read out of the GPU layout where only it is
        kept."""
        return self.pairs if self.pairs is not None else unpack_int4_tensor_core(self.weight)

    def _apply(self, fn, recurse=True):
        # The codes and their bf16 scale-and-zero are the quantized weight: only their device follows
        # the module (a cast to float16 would round the offsets), and a GPU gets its own packing.
        weight, kept, scale_and_zero = self.weight, self.pairs, self.scale_and_zero
        result = super()._apply(fn, recurse)
        device = self.scale_and_zero.device
        self.scale_and_zero = scale_and_zero.to(device=device)
        if device.type == "cuda" and weight.dim() == 4 and weight.device == device:  # already packed there
            self.weight, self.pairs = weight, None if kept is None else kept.to(device=device)
        else:
            pairs = (kept if kept is not None else unpack_int4_tensor_core(weight)).to(device=device)
            if device.type == "cuda":
                self.weight, self.pairs = self.pack_for_gpu(pairs)
            else:
                self.weight = self.pairs = pairs
        self._cpu_packed = None
        return result

    def pack_for_gpu(self, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tinygemm's tensor-core layout of ``pairs`` (torch's own packing), and the pairs to keep beside it: None
        where they read back out of the layout exactly (one copy of the codes), else ``pairs``."""
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, self.inner_k_tiles)
        if torch.equal(unpack_int4_tensor_core(packed), pairs):
            return packed, None
        _warn_layout_unread()
        return packed, pairs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.perm is not None:
            flat = flat.index_select(1, self.perm)
        flat = flat.contiguous()
        if flat.shape[0] >= DEQUANT_MIN_ROWS:
            y = flat @ self.dequantized_weight(torch.bfloat16).T
        elif self.packed_for_gpu:
            y = torch.ops.aten._weight_int4pack_mm(flat, self.weight, self.group, self.scale_and_zero)
        else:
            if self._cpu_packed is None:
                self._cpu_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpaired(self.weight), 1)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self._cpu_packed, self.group, self.scale_and_zero)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``(N, K)`` in ``dtype``, its columns in the codes' (act-order sorted) order: ``(q - 8) * scale +
        offset`` per group, as both kernels compute it."""
        codes = unpaired(self.nibble_pairs()).to(dtype).view(self.out_features, -1, self.group)
        scale, offset = self.scale_and_zero.to(dtype).permute(2, 1, 0).unsqueeze(-1)  # (N, K / group, 1) each
        return ((codes - 8) * scale + offset).view(self.out_features, self.in_features)

    def extra_repr(self) -> str:
        act = ", act-order" if self.perm is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, tinygemm g{self.group}{act}"


@functools.cache
def _warn_layout_unread() -> None:
    warnings.warn(
        "this torch's tinygemm layout is not the one lmpress reads codes back from: W4 layers on the GPU keep a "
        "second copy of their codes for prefill",
        stacklevel=3,
    )


def tinygemm_linear(layer: QuantizedLinear, dtype: torch.dtype | None = None) -> TinyGemmLinear:
    """``layer`` repacked for tinygemm (``select.kernel_candidates`` has checked that it holds the layer)."""
    width = layer.scheme.group_width(layer.in_features)
    group = kernel_group(width)
    codes, perm = layer.codes(), None
    if not trivial_g_idx(layer.g_idx, layer.in_features, layer.scheme):
        perm = torch.argsort(layer.g_idx.long(), stable=True)
        codes = codes[:, perm]
    scale_and_zero = int4pack_scale_and_zero(layer.scales, layer.zeros, width // group)
    bias = None if layer.bias is None else layer.bias.detach().float().clone()
    return TinyGemmLinear(nibble_pairs(codes), scale_and_zero, group, perm, bias)
