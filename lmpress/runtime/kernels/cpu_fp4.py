"""NVFP4 and MXFP4 weight-only layers (A16) on the CPU: FP4 weights times int8 activations (``cpu_fp4.cpp``).

``Fp4Linear``'s own forward dequantizes its weight and runs ``F.linear`` in float. ``Fp4A8Linear`` runs
``torch.ops.lmpress_cpu.fp4_linear`` (AVX2 or portable C++) or ``fp4_linear_t16`` (AVX-512 VNNI, outputs in lanes),
the W4 kernels of ``cpu_int.cpp`` with one more step: each E2M1 code becomes the integer ``2 * e2m1 + 12`` by a
16-entry byte lookup, and the activations are quantized as for the W4 kernels (int8 per 4 values), so the two run
the same integer dot products on the same bytes. Block scales stay the checkpoint's bytes (E4M3 for NVFP4, E8M0 for
MXFP4; 4.5 and 4.25 bits per weight in all), decoded in the kernel; NVFP4's per-tensor global scale is a per-row
factor, so layers fused by rows (q/k/v, gate/up) keep each their own (``fp4_cpu_fused``). The codes are repacked
once at load: ``repack_fp4`` (AVX2, portable: each SIMD lane holds one block throughout a superblock, so the block
scales cost what the W4 kernel's group scale costs) or ``repack_fp4_t16`` (AVX-512).

``fp4_cpu_module(layer)`` is the runtime's entry: the module, or None where the kernel cannot run the layer.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from lmpress.runtime.kernels import cpu_int
from lmpress.runtime.kernels.cpu_int import ISA_NAMES, TILE, finish_output, huge_pages, repack_w4_t16
from lmpress.weights.fp4 import FP4_BLOCK, Fp4Linear, unpack_fp4

KERNEL = "cpu-fp4a8"
SOURCE = Path(__file__).with_name("cpu_fp4.cpp")  # built into cpu_int.py's library (cpu_int.SOURCES)
SUPERBLOCK = cpu_int.BLOCK  # in_features must be a multiple of it (64 columns: 4 NVFP4 blocks, 2 MXFP4 blocks)


@functools.cache
def available() -> bool:
    """Whether the library is built (with this op) on this host."""
    return cpu_int.available() and hasattr(torch.ops.lmpress_cpu, "fp4_linear")


def scale_bytes(layer: Fp4Linear) -> torch.Tensor:
    """The layer's block scales as the bytes the checkpoint stores: E4M3 bits (NVFP4) or E8M0 exponents (MXFP4)."""
    scales = layer.weight_scale.detach()
    return scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales


def scales_in_range(fmt: str, scales: torch.Tensor) -> bool:
    """Whether every scale byte is one the SIMD paths decode exactly (in registers, without a table): NVFP4 not
    negative nor NaN (sign bit clear, not 0x7F); MXFP4 2^-126 to 2^127 (not 0, nor 255, E8M0's NaN). Quantizers
    write no others."""
    if fmt == "nvfp4":
        return bool(((scales & 0x80) == 0).all() and (scales != 0x7F).all())
    return bool(((scales != 0) & (scales != 255)).all())


def refusal(layer: nn.Module) -> str | None:
    """Why the kernel cannot run ``layer`` (None where it can)."""
    if not isinstance(layer, Fp4Linear):
        return f"{type(layer).__name__} is not an Fp4Linear"
    if layer.scheme.activations is not None:
        return f"{layer.scheme.describe()} quantizes its activations to FP4 (W4A4): the kernel takes int8 ones"
    if layer.weight_packed.device.type != "cpu":
        return "the layer is not on the CPU"
    if layer.in_features % SUPERBLOCK:
        return f"in_features {layer.in_features} is not a multiple of {SUPERBLOCK}"
    if not scales_in_range(layer.fmt, scale_bytes(layer)):
        return "a block scale is negative, NaN or out of the kernel's range"
    if not available():
        return "lmpress's CPU kernels did not build on this host"
    return None


def row_scales(layer: Fp4Linear) -> torch.Tensor:
    """float32 ``(out,)``: each output row's factor, ``1 / global_scale`` (NVFP4) or 1 (MXFP4)."""
    if layer.fmt == "nvfp4":
        return (1.0 / layer.weight_global_scale.detach().double()).float().expand(layer.out_features).clone()
    return torch.ones(layer.out_features)


def superblock_columns(block: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a superblock of ``blocks`` blocks in the "wide" layout: the column (of the superblock) of each byte's low
    nibble and of its high nibble (cpu_fp4.cpp's ``lane_column``)."""
    steps = 8 * block // 32 if blocks == 8 else 2
    byte = torch.arange(steps * 16)
    lane, code, vector = (byte % 32) // 4, byte % 4, byte // 32

    def column(step: torch.Tensor) -> torch.Tensor:
        return block * (lane % blocks) + 4 * ((lane // blocks) * steps + step) + code

    return column(2 * vector), column(2 * vector + 1)


def repack_fp4(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """``(out, in)`` E2M1 codes as the AVX2 and portable paths read them (``fp4_linear`` in cpu_fp4.cpp, the "wide"
    layout), ``(out, in / 2)`` bytes: superblocks of 8 blocks, then of 64 columns for the rest; in a superblock's
    32-byte vector v, byte ``4 i + c`` holds int32 lane ``i``'s code ``c`` of step ``2 v`` (low nibble) and ``2 v + 1``
    (high), lane ``i`` of every step a column of block ``i mod nb`` (``superblock_columns``). So one vector of scales
    (lane ``i``: block ``i mod nb``) multiplies a superblock's lane sums once."""
    out, k = codes.shape
    block = FP4_BLOCK[fmt]
    codes = codes.to(torch.uint8)
    parts, col = [], 0
    while col < k:
        blocks = 8 if col + 8 * block <= k // (8 * block) * 8 * block else SUPERBLOCK // block
        low, high = superblock_columns(block, blocks)
        parts.append(codes[:, col + low] | (codes[:, col + high] << 4))
        col += blocks * block
    return torch.cat(parts, dim=1).contiguous()


def repack_fp4_t16(
    codes: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, in)`` E2M1 codes, ``(out, in / block)`` scale bytes and ``(out,)`` row scales as the AVX-512 kernel
    reads them (``fp4_linear_t16`` in cpu_fp4.cpp): rows padded to tiles of 16 (scale bytes and row scales 0);
    codes ``(tiles, in / 64, 8, 64)`` as ``cpu_int.repack_w4_t16``'s (vector j of a 64-column superblock holding at
    byte ``4 l + i`` code ``4 j + i`` of the tile's row l in its low nibble and code ``32 + 4 j + i`` in its high
    one); scale bytes ``(tiles, in / block, 16)``, each block's 16 rows together; row scales ``(tiles, 16)``."""
    out = codes.shape[0]
    tiles = -(-out // TILE)
    pad = tiles * TILE - out
    none = torch.zeros(out, 1)
    packed, _, _ = repack_w4_t16(codes, none, none)
    scales = torch.nn.functional.pad(scales, (0, 0, 0, pad)).reshape(tiles, TILE, -1).transpose(1, 2)
    row_scale = torch.nn.functional.pad(row_scale.float(), (0, pad)).reshape(tiles, TILE)
    return packed, scales.contiguous(), row_scale.contiguous()


class Fp4A8Linear(nn.Module):
    """``x Wᵀ + b`` with ``W`` NVFP4 or MXFP4 (E2M1 codes, block scales as bytes, a factor per output row) and ``x``
    quantized to int8 per 4 values, through ``torch.ops.lmpress_cpu.fp4_linear`` (``_t16`` on AVX-512 VNNI).

    ``codes``: uint8 ``(out, in)`` E2M1 codes; ``scales``: uint8 ``(out, in / block)``, E4M3 bits (``fmt``
    "nvfp4", blocks of 16) or E8M0 exponents ("mxfp4", blocks of 32); ``row_scale``: float32 ``(out,)``.
    Float32 rows in (any count: passes of up to 8 rows share each weight load), float32 out."""

    KERNEL = KERNEL

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        row_scale: torch.Tensor,
        fmt: str,
        bias: torch.Tensor | None = None,
        isa: int | None = None,
    ) -> None:
        super().__init__()
        cpu_int.load_library()
        self.out_features, self.in_features = codes.shape
        self.fmt, self.block = fmt, FP4_BLOCK[fmt]
        if self.in_features % SUPERBLOCK or scales.shape != (self.out_features, self.in_features // self.block):
            raise ValueError(f"FP4 kernel shapes: codes {tuple(codes.shape)}, scales {tuple(scales.shape)}")
        self.isa = cpu_int.host_isa() if isa is None else isa
        scales = scales.to(torch.uint8)
        if self.isa == 2:
            codes, scales, row_scale = repack_fp4_t16(codes, scales, row_scale)
        else:
            codes, scales, row_scale = repack_fp4(codes, fmt), scales.contiguous(), row_scale.float().contiguous()
        self.register_buffer("codes", huge_pages(codes))
        self.register_buffer("scales", scales)
        self.register_buffer("row_scale", row_scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_layers(cls, layers: list[Fp4Linear], isa: int | None = None) -> Fp4A8Linear:
        """One module computing every layer of ``layers`` (the same format and in_features), rows concatenated."""
        first = layers[0]
        if any(layer.fmt != first.fmt or layer.in_features != first.in_features for layer in layers):
            raise ValueError("fused FP4 layers share a format and in_features")
        codes = torch.cat([unpack_fp4(layer.weight_packed.detach()) for layer in layers])
        scales = torch.cat([scale_bytes(layer) for layer in layers])
        row_scale = torch.cat([row_scales(layer) for layer in layers])
        bias = None
        if any(layer.bias is not None for layer in layers):
            bias = torch.cat(
                [torch.zeros(m.out_features) if m.bias is None else m.bias.detach().float() for m in layers]
            )
        return cls(codes, scales, row_scale, first.fmt, bias, isa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        if self.isa == 2:
            y = torch.ops.lmpress_cpu.fp4_linear_t16(
                flat, self.codes, self.scales, self.row_scale, self.block, self.out_features
            )
        else:
            y = torch.ops.lmpress_cpu.fp4_linear(flat, self.codes, self.scales, self.row_scale, self.block, self.isa)
        return finish_output(y, x, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}, {ISA_NAMES[self.isa]}"


def fp4_cpu_module(layer: nn.Module, isa: int | None = None) -> nn.Module | None:
    """``layer`` (an A16 ``Fp4Linear``) on the FP4 CPU kernel, or None where the kernel cannot run it (``refusal``:
    W4A4, in_features not a multiple of 64, out-of-range scales, not on the CPU, no library)."""
    if refusal(layer) is not None:
        return None
    return Fp4A8Linear.from_layers([layer], isa)


def fp4_cpu_fused(layers: list[nn.Module], isa: int | None = None) -> nn.Module | None:
    """Layers sharing an input (q/k/v, gate/up) as one ``Fp4A8Linear``, outputs concatenated; None unless the kernel
    runs every one and they share a format and in_features."""
    if not layers or any(refusal(layer) is not None for layer in layers):
        return None
    first = layers[0]
    if any(layer.fmt != first.fmt or layer.in_features != first.in_features for layer in layers):
        return None
    return Fp4A8Linear.from_layers(layers, isa)
