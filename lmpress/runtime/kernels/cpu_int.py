"""lmpress's own CPU kernels: 4-bit (groups of 64k) and per-row 8-bit weights times int8 activations.

The C++ source (``cpu_int.cpp``) is compiled once per host and torch version into lmpress's cache
(``torch.utils.cpp_extension``, the C++ compiler torch.compile on the CPU needs anyway) and registered
as the torch ops ``torch.ops.lmpress_cpu.w4_linear`` / ``w8_linear`` with fake implementations, so a
decode step containing them compiles with ``torch.compile`` in one graph. Activations are quantized
per block of 4 to int8 (llama.cpp's Q8_0 blocks are 32) and dotted with the weight codes in integers:
AVX-512 VNNI ``vpdpbusd`` where the CPU has it, AVX2 ``vpmaddubsw`` otherwise, portable C++ on a CPU
without AVX2 (with a warning). One pass over the weights serves up to 8 input rows (speculative
verification) at once. Weights are repacked once at load (``repack_w4``); where the library cannot be
built (no compiler), ``available()`` is False and the runtime keeps torch's packed kernels.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from lmpress.runtime.kernels.cpp_build import build_directory, build_library
from lmpress.weights.int8_linear import register_cpu_w8a8_kernel, w8a8_output

SOURCE = Path(__file__).with_name("cpu_int.cpp")
# The library's other sources: cpu_attention.cpp (attention over the filled slots of a cache, cpu_attention.py),
# cpu_kv_attention.cpp (the same over float32 or int8 caches on AVX2, cpu_kv_attention.py), cpu_half.cpp (float32
# rows times bfloat16 or float16 weights, cpu_half.py), cpu_fp4.cpp (NVFP4 and MXFP4 weights times int8
# activations, cpu_fp4.py) and cpu_hadamard.cpp (the blockwise Walsh-Hadamard transform, hadamard.py)
NAMES = ("cpu_attention", "cpu_kv_attention", "cpu_half", "cpu_fp4", "cpu_hadamard")
SOURCES = (SOURCE, *(Path(__file__).with_name(f"{name}.cpp") for name in NAMES))
# Included by the sources (cpu_int.cpp's AVX2 and AVX-512 kernels, the activation quantizer cpu_int.cpp and cpu_fp4.cpp
# share, cpu_kv_attention.cpp's vector body): part of the build's digest.
HEADERS = tuple(
    Path(__file__).with_name(name)
    for name in ("cpu_int_avx2.h", "cpu_int_avx512.h", "cpu_quantize_acts.h", "cpu_kv_rows.h")
)
BLOCK = 64  # the weight superblock (fixed in cpu_int.cpp): in_features and W4's groups are multiples of it
ACTIVATION_BLOCK = 4  # one int8 scale per this many activations (fixed in cpu_int.cpp)
ISA_NAMES = {0: "portable C++", 1: "AVX2", 2: "AVX-512 VNNI"}
# What weight-only quantized layers take their activations as on the CPU: "int8" (per 4 values, these kernels, where
# they hold the layer and build) or "bf16" (torch's packed kernels, kernels/cpu.py).
CPU_ACTIVATIONS = ("int8", "bf16")
DEFAULT_CPU_ACTIVATIONS = "int8"


@functools.cache
def available() -> bool:
    """Whether the library is built (building it now if needed) and loaded; a failed build warns once."""
    try:
        load_library()
    except Exception as error:  # no compiler, no headers: torch's kernels still run every layer
        warnings.warn(
            f"lmpress's CPU int8 kernels did not build ({error}); torch's packed kernels run instead", stacklevel=2
        )
        return False
    return True


CFLAGS, LDFLAGS = ["-O3", "-fopenmp", "-std=c++17"], ["-fopenmp"]  # the kernels' build, also bench/kernel_at_rev.py's


@functools.cache
def load_library() -> None:
    """Build (once per host and torch version, into lmpress's cache) and load the kernels' library."""
    text = b"".join(s.read_bytes() for s in (*SOURCES, *HEADERS))
    name, build = build_directory("lmpress_cpu_int", text, [*CFLAGS, *LDFLAGS])
    build_library(name, SOURCES, build, CFLAGS, "its CPU kernels", extra_ldflags=LDFLAGS)
    _register_fakes()


def _register_fakes() -> None:
    def fake_linear(x, codes, scales, zeros, isa, *options):  # noqa: ANN001, ANN202 - torch.library's signature
        return x.new_empty(x.shape[0], codes.shape[0])

    def fake_tiled(x, codes, scales, zeros, out_features, *options):  # noqa: ANN001, ANN202 - torch.library's
        return x.new_empty(x.shape[0], out_features)

    for op in ("w4_linear", "w8_linear"):
        torch.library.register_fake(f"lmpress_cpu::{op}")(fake_linear)
    for op in ("w4_linear_t16", "w8_linear_t16"):
        torch.library.register_fake(f"lmpress_cpu::{op}")(fake_tiled)

    @torch.library.register_fake("lmpress_cpu::fp4_linear")
    def fake_fp4(x, codes, scales, row_scale, block, isa):  # noqa: ANN001, ANN202 - torch.library's signature
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("lmpress_cpu::fp4_linear_t16")
    def fake_fp4_tiled(x, codes, scales, row_scale, block, out_features):  # noqa: ANN001, ANN202 - torch.library's
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("lmpress_cpu::hadamard_blocks")
    def fake_hadamard(x, block):  # noqa: ANN001, ANN202 - torch.library's signature
        return torch.empty_like(x)

    if hasattr(torch.ops.lmpress_cpu, "slots_attention"):  # x86-64 builds only

        @torch.library.register_fake("lmpress_cpu::slots_attention")
        def fake_attention(q, keys, values, mask, scale):  # noqa: ANN001, ANN202 - torch.library's signature
            return q.new_empty(*q.shape[:3], values.shape[-1])

        @torch.library.register_fake("lmpress_cpu::kv_slots_attention")
        def fake_kv_attention(
            q: torch.Tensor,
            keys: torch.Tensor,
            key_scales: torch.Tensor | None,
            values: torch.Tensor,
            value_scales: torch.Tensor | None,
            mask: torch.Tensor,
            scale: float,
            isa: int = -1,
            recent_keys: torch.Tensor | None = None,
            pos: torch.Tensor | None = None,
        ) -> torch.Tensor:
            return q.new_empty(q.shape)

        @torch.library.register_fake("lmpress_cpu::half_linear")
        def fake_half_linear(x, weight, isa, prefetch=4608, rows=4):  # noqa: ANN001, ANN202 - torch.library's signature
            return x.new_empty(x.shape[0], weight.shape[0])


@functools.cache
def host_isa() -> int:
    """The best instruction set level of this CPU the kernels use (``ISA_NAMES``); warns once without AVX2."""
    load_library()
    level = cpu_isa()
    if level == 0:
        warnings.warn(
            "this CPU has no AVX2 (or no FMA): lmpress's int8 CPU kernels run their portable C++ path, "
            "several times slower than on an AVX2 CPU",
            stacklevel=2,
        )
    return level


def cpu_isa() -> int:
    """What the library detects on this CPU (``ISA_NAMES``)."""
    return int(torch.ops.lmpress_cpu.cpu_isa())


def repack_w4(codes: torch.Tensor) -> torch.Tensor:
    """``(out, in)`` 4-bit codes as the kernel reads them: per 64 codes, 32 bytes holding code j (low nibble) and
    code j + 32 (high nibble)."""
    out, k = codes.shape
    blocks = codes.to(torch.uint8).reshape(out, k // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out, k // 2).contiguous()


TILE = 16  # output rows per tile of the AVX-512 layouts
DEFAULT_PREFETCH = 4096  # bytes ahead of the weights being dotted (cpu_int.cpp's PREFETCH_BYTES)
# Weights from this size on are copied into memory advised for transparent huge pages (``huge_pages``): SmolLM2's
# W8 head (28 MiB) streamed 7-8% faster that way on a Xeon with THP "madvise"; the layers' weights (under 2 MiB
# each) would mostly be padding.
HUGE_PAGE_BYTES = 16 * 2**20


def huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or where it holds ``HUGE_PAGE_BYTES`` or more, a copy in 2 MiB-aligned memory advised for
    transparent huge pages (fewer TLB misses while a decode step streams it)."""
    if t.nbytes < HUGE_PAGE_BYTES:
        return t
    return torch.ops.lmpress_cpu.huge_page_copy(t.contiguous())


def gather_into_huge_pages(modules: Iterable[nn.Module]) -> int:
    """Moves the buffers under ``HUGE_PAGE_BYTES`` of ``modules`` (lmpress's CPU kernels: codes, scales, zeros,
    biases), in the order given, into one block of 2 MiB-aligned memory advised for transparent huge pages, each at
    a 64-byte boundary; returns the bytes moved. A decode step streams the layers' weights, each layer's a few
    hundred KiB: in 4 KiB pages every page is a TLB miss. SmolLM2 W4's 120 layer products on a Zen 4 EPYC, 2
    threads: 0.87x the time gathered at one input row, 0.93x at four (``bench/cpu_int_kernels.py --gathered``). The
    modules' references move to the block as each buffer is copied."""
    owners: dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str]]]] = {}
    for module in modules:
        for name, t in module.named_buffers(recurse=False):
            if t is not None and t.device.type == "cpu" and t.is_contiguous() and 0 < t.nbytes < HUGE_PAGE_BYTES:
                owners.setdefault(id(t), (t, []))[1].append((module, name))
    sizes = [-(-t.nbytes // 64) * 64 for t, _ in owners.values()]
    if not sizes:
        return 0
    load_library()
    block = torch.ops.lmpress_cpu.huge_page_empty(sum(sizes))
    offset = 0
    for (t, places), size in zip(owners.values(), sizes, strict=True):
        moved = block[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        moved.copy_(t)
        for module, name in places:
            module._buffers[name] = moved
        offset += size
    return offset


def repack_w4_t16(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, in)`` 4-bit codes, ``(out, G)`` scales and zeros as AVX-512's outputs-in-lanes kernel reads them
    (``w4_linear_t16`` in cpu_int.cpp): rows padded to tiles of 16 (scale 0); codes ``(tiles, in / 64, 8, 64)``,
    vector j of a 64-block holding at byte ``4 l + i`` code ``4 j + i`` of the tile's row l (low nibble) and code
    ``32 + 4 j + i`` (high nibble); scales and zeros ``(tiles, G, 16)``."""
    out, k = codes.shape
    tiles = -(-out // TILE)
    pad = tiles * TILE - out
    codes = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    scales = torch.nn.functional.pad(scales, (0, 0, 0, pad))
    zeros = torch.nn.functional.pad(zeros, (0, 0, 0, pad))
    c = codes.reshape(tiles, TILE, k // BLOCK, 2, 8, 4)  # [tile, row, block, half, j, i]: code 32 half + 4 j + i
    packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(tiles, k // BLOCK, 8, 64)

    def by_tile(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(tiles, TILE, -1).transpose(1, 2).contiguous()

    return packed.contiguous(), by_tile(scales), by_tile(zeros)


def repack_w8_t16(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, in)`` 8-bit codes and ``(out,)`` scales and zeros as AVX-512's outputs-in-lanes kernel reads them
    (``w8_linear_t16`` in cpu_int.cpp): rows padded to tiles of 16; codes ``(tiles, in / 64, 16, 64)``, vector j of
    a 64-block holding at byte ``4 l + i`` code ``4 j + i`` of the tile's row l; scales and zeros ``(tiles, 16)``."""
    out, k = codes.shape
    tiles = -(-out // TILE)
    pad = tiles * TILE - out
    codes = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    packed = codes.reshape(tiles, TILE, k // BLOCK, 16, 4).permute(0, 2, 3, 1, 4).reshape(tiles, k // BLOCK, 16, 64)
    scales, zeros = (torch.nn.functional.pad(t, (0, pad)).reshape(tiles, TILE) for t in (scales, zeros))
    return packed.contiguous(), scales.contiguous(), zeros.contiguous()


def unpack_w8_t16(codes: torch.Tensor, out: int) -> torch.Tensor:
    """``repack_w8_t16``'s codes back as ``(out, in)``."""
    tiles, blocks = codes.shape[:2]
    rows = codes.reshape(tiles, blocks, 16, TILE, 4).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, blocks * BLOCK)
    return rows[:out]


def w4_fits(in_features: int, group_width: int, act_order: bool) -> bool:
    return not act_order and in_features % BLOCK == 0 and group_width % BLOCK == 0 and in_features % group_width == 0


# w8_token_linear sums a row's products in int32: 65536 * 127 * 255 < 2**31 (cpu_int.cpp's w8_linear checks the same
# width, the last guard for a direct caller; a test holds the two together)
MAX_TOKEN_FEATURES = 65536


def w8_fits(in_features: int, group_width: int, act_order: bool, per_token: bool = False) -> bool:
    """Whether ``w8_linear`` holds a per-row 8-bit layer; per token (W8A8: int32 row sums) it bounds the width."""
    fits = not act_order and in_features % BLOCK == 0 and group_width == in_features
    return fits and (not per_token or in_features <= MAX_TOKEN_FEATURES)


class Int8ActivationLinear(nn.Module):
    """``(q - zero) * scale`` weight codes times activations quantized to int8 per 4, through the torch op ``OP``;
    subclasses lay the weight out for it (``layout``). ``isa`` (default: the host's best level) and ``prefetch``
    (bytes ahead; default ``DEFAULT_PREFETCH``) choose the variant: the runtime passes this host's probed choice
    for the weight's shape (``cpu_probe.choose_int8_kernel``)."""

    KERNEL = ""
    OP = ""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None,
        isa: int | None = None,
        prefetch: int | None = None,
        per_token: bool = False,
    ) -> None:
        super().__init__()
        load_library()
        self.out_features, self.in_features = codes.shape
        self.isa = self.level(host_isa() if isa is None else isa, per_token)
        self.prefetch = DEFAULT_PREFETCH if prefetch is None else prefetch
        self.per_token = per_token  # one activation scale a row (a W4A8 or W8A8 scheme's), not one per 4 values
        codes, scales, zeros = self.layout(codes, scales.float(), zeros.round().to(torch.uint8), self.isa)
        self.register_buffer("codes", huge_pages(codes))
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("bias", bias)

    @staticmethod
    def layout(
        codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, isa: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (codes, float32 scales, uint8 zeros) buffers as the op for ``isa`` reads them."""
        raise NotImplementedError

    @staticmethod
    def level(isa: int, per_token: bool) -> int:
        """The instruction set level the layer runs at when ``isa`` is asked for."""
        return isa

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        """``(rows, in)`` float32 contiguous input times the weight, ``(rows, out)`` float32."""
        per_token = int(self.per_token)  # an int: see cpu_int.cpp's op definitions
        if self.isa == 2:  # outputs in lanes: OP's "_t16" twin, which takes the output count instead of the ISA
            tiled = getattr(torch.ops.lmpress_cpu, f"{self.OP}_t16")
            return tiled(flat, self.codes, self.scales, self.zeros, self.out_features, self.prefetch, per_token)
        return getattr(torch.ops.lmpress_cpu, self.OP)(
            flat, self.codes, self.scales, self.zeros, self.isa, self.prefetch, per_token
        )

    def finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The product's float32 rows ``y`` as the layer returns them (``finish_output``)."""
        return finish_output(y, x, self.bias, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.product(x.reshape(-1, self.in_features).float().contiguous()), x)


class W4A8Linear(Int8ActivationLinear):
    """``(q - zero) * scale`` 4-bit weights in groups of 64k columns, times activations quantized to int8 per 4."""

    KERNEL = "cpu-w4a8"
    OP = "w4_linear"

    @staticmethod
    def layout(
        codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, isa: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if isa == 2:  # outputs in lanes (w4_linear_t16)
            return repack_w4_t16(codes, scales, zeros)
        return repack_w4(codes), scales.contiguous(), zeros.contiguous()

    def extra_repr(self) -> str:
        group = self.in_features // self.scales.shape[1]
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int4 g{group}, {ISA_NAMES[self.isa]}, "
            f"prefetch {self.prefetch}" + (", int8 activations per token" if self.per_token else "")
        )


class W8A8RowLinear(Int8ActivationLinear):
    """Per-row ``(q - zero) * scale`` 8-bit weights times activations quantized to int8 per 4, or per token (a W8A8
    scheme's): then summed exactly in int32 as ``torch._int_mm`` sums them, on the AVX2 path on AVX-512 hosts too."""

    KERNEL = "cpu-w8a8"
    OP = "w8_linear"

    @staticmethod
    def level(isa: int, per_token: bool) -> int:
        return min(isa, 1) if per_token else isa  # the exact int32 path has AVX2 and portable bodies (w8_token_linear)

    @staticmethod
    def layout(
        codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, isa: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scales, zeros = scales.reshape(-1), zeros.reshape(-1)
        if isa == 2:  # outputs in lanes (w8_linear_t16)
            return repack_w8_t16(codes, scales, zeros)
        return codes.to(torch.uint8).contiguous(), scales.contiguous(), zeros.contiguous()

    def finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if not self.per_token:
            return super().finish(y, x)
        # torch._int_mm's tail (w8a8_linear): the bias added in float32, so a bfloat16 layer gives its bits too
        return w8a8_output(y, x, self.bias)

    def rows(self, rows: torch.Tensor) -> W8A8RowLinear:
        """A copy computing only output rows ``rows``."""
        bias = None if self.bias is None else self.bias[rows].clone()
        codes, scales, zeros = self.codes, self.scales, self.zeros
        if self.isa == 2:
            codes = unpack_w8_t16(codes, self.out_features)
            scales, zeros = scales.reshape(-1)[: self.out_features], zeros.reshape(-1)[: self.out_features]
        return W8A8RowLinear(
            codes[rows], scales[rows], zeros[rows].float(), bias, self.isa, self.prefetch, self.per_token
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row, {ISA_NAMES[self.isa]}, "
            f"prefetch {self.prefetch}" + (", int8 activations per token" if self.per_token else "")
        )


@register_cpu_w8a8_kernel
def w8a8_product(codes: torch.Tensor, scales: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """An evaluated W8A8 layer's product (``QuantizedLinear``, symmetric codes, zero 128) on this kernel, per token:
    the same bits as ``torch._int_mm``; None where the kernel does not hold it or does not build."""
    in_features = codes.shape[1]
    if not w8_fits(in_features, in_features, act_order=False, per_token=True) or not available():
        return None
    zeros = torch.full((codes.shape[0], 1), 128.0)
    return W8A8RowLinear(codes, scales, zeros, None, per_token=True).product


def finish_output(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """A CPU kernel's float output ``y`` (rows, out) as the module returns it: ``x``'s dtype, plus ``bias``,
    ``x``'s leading shape."""
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], out_features)


def quantize_activations(
    x: torch.Tensor, isa: int | None = None, per_token: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes ``(M, K)`` and per-4 scales ``(M, K / 4)`` the kernels take ``x`` as (for tests); with
    ``per_token``, a W4A8 or W8A8 layer's: every block of a row at the row's scale."""
    isa = host_isa() if isa is None else isa
    return torch.ops.lmpress_cpu.quantize_activations(x.float().contiguous(), isa, per_token)
