"""Triton kernels for CUDA: W4A16 / W8A16 dequantize-and-multiply and a fused RMSNorm.

The weight layout and the helpers that read codes are in ``triton_pack`` (``prepare_w4a16`` /
``prepare_w8a16`` repack once at load); the decode GEMVs are in ``triton_gemv``. Here: the fused
GEMM (9-127 rows), the dequantize kernel that prefill (128 rows and more) runs before cuBLAS,
RMSNorm, the autotuning configurations and the entry points, ``w4a16_matmul`` / ``w8a16_matmul``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lmpress.runtime.kernels.triton_gemv import _gemv_kernel, _gemv_row_kernel
from lmpress.runtime.kernels.triton_pack import (
    PackedWeight,
    _code_weight_inverse,
    _load_block_qparams,
    _scaled_codes_f32,
    prepare_w4a16,
    prepare_w8a16,
)
from lmpress.runtime.kernels.tuning import remembered, tune_space, tuned_choice

__all__ = ["PackedWeight", "dequantize", "matmul_path", "prepare_w4a16", "prepare_w8a16", "rms_norm"]
__all__ += ["w4a16_matmul", "w8a16_matmul"]

DECODE_MAX_ROWS = 8


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, y_ptr,
    M, N, K, KW, G, stride_xm, stride_ym,
    BITS: tl.constexpr, C: tl.constexpr, ZERO: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, GROUP_M: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """``y = x @ W.T`` (prefill): BM x BN output tiles, W tiles dequantized in registers and fed to ``tl.dot``."""
    PER: tl.constexpr = 32 // BITS
    T: tl.constexpr = C // PER
    BK: tl.constexpr = NB * C
    # Grouped program order so consecutive programs share W tiles in L2 (Triton's matmul tutorial).
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % size_m
    pid_n = (pid % (GROUP_M * grid_n)) // size_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_r = tl.arange(0, T)
    shifts = tl.arange(0, PER) * BITS
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for b0 in range(0, G, NB):
        offs_b = b0 + tl.arange(0, NB)
        mask_b = offs_b < G
        cols = b0 * C + tl.arange(0, BK)
        mask_k = cols < K
        src = tl.load(perm_ptr + cols, mask=mask_k, other=0) if HAS_PERM else cols
        a = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + src[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        word_idx = offs_b[:, None] * T + offs_r[None, :]
        mask_w = mask_n[:, None, None] & mask_b[None, :, None]
        words = tl.load(w_ptr + offs_n[:, None, None] * KW + word_idx[None, :, :], mask=mask_w, other=0)
        scale, zero = _load_block_qparams(s_ptr, z_ptr, offs_n, offs_b, mask_n[:, None] & mask_b[None, :], G, ZERO)
        q = (words[:, :, :, None] >> shifts[None, None, None, :]) & ((1 << BITS) - 1)  # [BN, NB, T, PER]
        q = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        w = ((q - zero[:, :, None, None]) * scale[:, :, None, None]).to(a.dtype)
        # Code j of word r is column j * T + r of its block: (r, j) -> (j, r) restores column order.
        w = tl.reshape(tl.permute(w, 0, 1, 3, 2), (BN, BK))
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _dequantize_kernel(
    w_ptr, s_ptr, z_ptr, out_ptr, N, KW, G, stride_out,
    BITS: tl.constexpr, C: tl.constexpr, ZERO: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """``out[:N, :K_pad] = (q - zero) * scale`` in ``out``'s dtype, columns in (sorted) order: BN rows x NB blocks."""
    PER: tl.constexpr = 32 // BITS
    T: tl.constexpr = C // PER
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_b = tl.program_id(1) * NB + tl.arange(0, NB)
    offs_r = tl.arange(0, T)
    mask_n = offs_n < N
    mask_b = offs_b < G
    mask = mask_n[:, None, None] & mask_b[None, :, None]
    words = tl.load(w_ptr + offs_n[:, None, None] * KW + (offs_b[:, None] * T + offs_r[None, :])[None, :, :], mask=mask)
    high = words >> 16
    scale, zero = _load_block_qparams(s_ptr, z_ptr, offs_n, offs_b, mask_n[:, None] & mask_b[None, :], G, ZERO)
    for j in tl.static_range(PER):
        q = _scaled_codes_f32(words, high, j, BITS) * _code_weight_inverse(j, BITS)
        w = (q - zero[:, :, None]) * scale[:, :, None]
        col = offs_b[:, None] * C + j * T + offs_r[None, :]  # code j of word r is column j * T + r
        tl.store(
            out_ptr + offs_n[:, None, None] * stride_out + col[None, :, :], w.to(out_ptr.dtype.element_ty), mask=mask
        )


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, H, stride_x, stride_r, stride_y, stride_h, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row per program: ``h = x (+ residual)``; ``y = h * rsqrt(mean(h**2) + eps) * weight``."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = x.to(tl.float32) + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        h = h.to(x.dtype)  # the sum is what an unfused model would hold in its residual stream
        tl.store(h_ptr + row * stride_h + offs, h, mask=mask)
        x = h
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (xf * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


# Configurations ---------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# Tests that only need correct results on a GPU set this False (fixed tiles compile in seconds).
AUTOTUNE = True


def _autotuning() -> bool:
    """Tune on CUDA unless ``AUTOTUNE`` is off or a tune space of ``off``; never when interpreting."""
    return AUTOTUNE and not _interpreting() and tune_space() != "off"


def _config(bn: int, nb: int, warps: int, stages: int = 2, **more: int) -> dict[str, int]:
    return {"BN": bn, "NB": nb, **more, "num_warps": warps, "num_stages": stages}


# H100: the GEMV wants thousands of programs with several loads in flight (row tiles of BN, NB
# blocks per iteration, SPLIT_K slices of K); the GEMM wants 128-256 wide tiles and a 3-4 stage
# pipeline. Each kept config is timed per layer shape on first use (``tuning.py``: once per GPU,
# then read from disk).
GEMV_CONFIGS = [  # 2-8 rows
    _config(bn, nb, 4, SPLIT_K=split) for bn in (8, 16, 32) for nb in (2, 4) for split in (1, 4, 8)
]
# One row: [BN, T] tiles; a thread holding several rows reuses each activation it loads (BN 64-256
# over 1-4 warps: 5.3-5.8 instructions per code in the loop's SASS, against 7.8-8.8 and 16-32
# barriers per iteration in the 4D kernel; bench/triton_sass.py). 40 configs, each compiled once.
GEMV_ROW_CONFIGS = [
    _config(bn, nb, w, SPLIT_K=split)
    for bn, w in ((32, 1), (64, 1), (64, 2), (128, 2), (256, 4))
    for nb in (1, 2)
    for split in (1, 2, 4, 8)
]
GEMM_CONFIGS = [
    _config(bn, nb, w, s, BM=bm, GROUP_M=8)
    for bm, bn, nb, w, s in [(128, 128, 1, 8, 3), (128, 256, 1, 8, 3), (256, 128, 1, 8, 3), (128, 128, 2, 8, 3)]
]
# tune space small: a fixed few of each, spanning tile width and split (a GPU visit's time budget).
SMALL_CONFIGS = {
    "gemv_row": [_config(64, 1, 1, SPLIT_K=1), _config(128, 2, 2, SPLIT_K=4), _config(256, 1, 4, SPLIT_K=8)],
    "gemv": [_config(16, 2, 4, SPLIT_K=1), _config(32, 2, 4, SPLIT_K=4), _config(16, 4, 4, SPLIT_K=8)],
    "gemm": GEMM_CONFIGS[:2],
}
# Untuned (interpreter, AUTOTUNE off): small tiles, a split of K so that path is exercised; the GEMM's BM follows M.
DEFAULT_GEMV = {"BN": 16, "NB": 2, "SPLIT_K": 2, "num_warps": 4}  # both GEMV kernels
DEFAULT_GEMM = {"BN": 16, "NB": 1, "GROUP_M": 4, "num_warps": 4}
# Split-K partial sums: at most this many fp32 values (32 MiB), shared by every layer on a device.
SPLIT_PARTIALS = 2**23
# From this many rows on, prefill dequantizes the weight into a scratch matrix and multiplies with
# cuBLAS (one pass over the weight, then the library's GEMM); below, the fused GEMM kernel.
DEQUANT_MIN_ROWS = 128
# The scratch matrix holds at most this many weights (128 MiB in bf16); larger layers go by row chunks.
SCRATCH_ELEMENTS = 2**26


def _splits_that_fit(configs: list[dict], n: int, blocks: int, rows: int) -> list[dict]:
    """A split needs >= NB blocks per slice and its partials within ``SPLIT_PARTIALS``."""
    return [
        c
        for c in configs
        if c["SPLIT_K"] == 1 or (c["SPLIT_K"] * c["NB"] <= blocks and c["SPLIT_K"] * rows * n <= SPLIT_PARTIALS)
    ]


def configs_for(kind: str, n: int = 0, blocks: int = 0, rows: int = 1) -> list[dict]:
    """The configurations tuned for ``kind`` ("gemv_row", "gemv", "gemm") in the tune space (``set_tune_space``)."""
    full = {"gemv_row": GEMV_ROW_CONFIGS, "gemv": GEMV_CONFIGS, "gemm": GEMM_CONFIGS}[kind]
    configs = SMALL_CONFIGS[kind] if tune_space() == "small" else full
    return configs if kind == "gemm" else _splits_that_fit(configs, n, blocks, rows)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def _tuned_config(kind: str, kernel, grid, args: tuple, flags: dict, shape: dict, device: torch.device) -> dict:
    """The fastest of ``configs_for(kind)`` at this shape (``tuning.tuned_choice``: timed once, kept on disk)."""
    key = (kind, str(device), tune_space(), *sorted(shape.items()))
    return remembered(key, lambda: _timed_config(kind, kernel, grid, args, flags, shape, device))


def _timed_config(kind: str, kernel, grid, args: tuple, flags: dict, shape: dict, device: torch.device) -> dict:
    import triton.testing

    candidates = configs_for(kind, shape["N"], shape["G"], shape.get("BM", 1))

    def seconds(config: dict) -> float:
        launch = lambda: kernel[grid(config)](*args, **flags, **config)  # noqa: E731
        return triton.testing.do_bench(launch, warmup=5, rep=20, return_mode="median") / 1e3

    return tuned_choice(_device_name(device), f"triton_{kind}", shape, candidates, seconds)


_SPLIT_WORKSPACE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_workspace(device: torch.device, partials: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial sums and per-row-tile arrival counters (kept at zero between calls) for split-K GEMVs."""
    part, count = _SPLIT_WORKSPACE.get(device, (None, None))
    if part is None or part.numel() < partials:
        part = torch.empty(partials, dtype=torch.float32, device=device)
    if count is None or count.numel() < tiles:
        count = torch.zeros(tiles, dtype=torch.int32, device=device)
    _SPLIT_WORKSPACE[device] = (part, count)
    return part, count


def _launch_gemv(args: tuple, flags: dict, m: int, n: int, device: torch.device) -> None:
    bm = triton.next_power_of_2(m)
    shape = {"N": n, "KW": args[10], "G": args[11], "BM": bm, "C": flags["C"], "BITS": flags["BITS"]}
    # Enough partials for the largest split any kept config can use, a counter per row for any BN.
    part, count = _split_workspace(device, min(SPLIT_PARTIALS, 16 * bm * n), n)
    args = (*args[:7], part, count, *args[7:])
    flags = {**flags, "BM": bm}
    kind, kernel = ("gemv_row", _gemv_row_kernel) if m == 1 else ("gemv", _gemv_kernel)
    grid = lambda config: (triton.cdiv(n, config["BN"]), config["SPLIT_K"])  # noqa: E731
    config = DEFAULT_GEMV
    if _autotuning():
        config = _tuned_config(kind, kernel, grid, args, flags, shape, device)
    kernel[grid(config)](*args, **flags, **config)


def _launch_gemm(args: tuple, flags: dict, m: int, n: int) -> None:
    # The interpreter's tl.dot multiplies bf16 bit patterns as integers (triton 3.9): dot in fp32 there.
    flags = {**flags, "DOT_F32": _interpreting()}
    grid = lambda config: (triton.cdiv(m, config["BM"]) * triton.cdiv(n, config["BN"]),)  # noqa: E731
    if _autotuning():
        shape = {"N": n, "KW": args[10], "G": args[11], "C": flags["C"], "BITS": flags["BITS"]}
        config = _tuned_config("gemm", _gemm_kernel, grid, args, flags, shape, args[0].device)
    else:
        config = {**DEFAULT_GEMM, "BM": min(128, max(16, triton.next_power_of_2(m)))}
    _gemm_kernel[grid(config)](*args, **flags, **config)


# Entry points -----------------------------------------------------------------------------


def _check_input(x: torch.Tensor, packed: PackedWeight) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"activations must be float16 or bfloat16, got {x.dtype}")
    if x.shape[-1] != packed.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {packed.in_features}")
    if x.device != packed.words.device:
        raise ValueError(f"input on {x.device} but the weight on {packed.words.device}")
    if x.device.type != "cuda" and not _interpreting():
        raise RuntimeError("Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for CPU testing)")


PATHS = ("gemv", "gemm", "dequant")


def matmul_path(rows: int) -> str:
    """The kernel ``rows`` activation rows run by default: the GEMV (decode), the fused GEMM, or dequantize + cuBLAS."""
    if rows <= DECODE_MAX_ROWS:
        return "gemv"
    return "gemm" if rows < DEQUANT_MIN_ROWS else "dequant"


def dequantize(packed: PackedWeight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight ``(N, K_pad)`` in ``dtype``, its columns in the packed (act-order sorted) order.

    Columns past ``in_features`` (per-channel K padded to the block) hold ``-zero * scale``: slice them off.
    """
    n, k_pad = packed.out_features, packed.n_blocks * packed.block
    if out is None:
        out = torch.empty((n, k_pad), dtype=dtype, device=packed.words.device)
    bn, nb = 16, 4
    _dequantize_kernel[(triton.cdiv(n, bn), triton.cdiv(packed.n_blocks, nb))](
        packed.words, packed.scales, packed.words if packed.zeros is None else packed.zeros, out,
        n, packed.words.shape[1], packed.n_blocks, out.stride(0),
        BITS=packed.bits, C=packed.block, ZERO=packed.zero, BN=bn, NB=nb, num_warps=4,
    )  # fmt: skip
    return out


_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _rows_of(packed: PackedWeight, first: int, last: int) -> PackedWeight:
    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[first:last]

    return PackedWeight(
        bits=packed.bits,
        in_features=packed.in_features,
        out_features=last - first,
        block=packed.block,
        words=rows(packed.words),
        scales=rows(packed.scales),
        zeros=rows(packed.zeros),
        zero=packed.zero,
        perm=packed.perm,
        bias=rows(packed.bias),
    )


def _dequantized_matmul(flat: torch.Tensor, packed: PackedWeight, y: torch.Tensor) -> None:
    """``y = flat @ W.T (+ bias)``: W dequantized into a per-device scratch matrix, by row chunks, then cuBLAS."""
    k, k_pad, n = packed.in_features, packed.n_blocks * packed.block, packed.out_features
    chunk = max(1, min(n, SCRATCH_ELEMENTS // k_pad))
    key = (flat.device, flat.dtype)
    scratch = _SCRATCH.get(key)
    if scratch is None or scratch.numel() < chunk * k_pad:
        scratch = _SCRATCH[key] = torch.empty(chunk * k_pad, dtype=flat.dtype, device=flat.device)
    a = flat if packed.perm is None else flat.index_select(1, packed.perm)
    for first in range(0, n, chunk):
        part = _rows_of(packed, first, min(n, first + chunk))
        w = dequantize(part, flat.dtype, scratch[: part.out_features * k_pad].view(part.out_features, k_pad))
        w = w[:, :k]
        out = y if chunk == n else None  # one chunk: cuBLAS writes y itself, no copy
        if part.bias is None:
            out = torch.mm(a, w.T, out=out)
        else:
            out = torch.addmm(part.bias.to(flat.dtype), a, w.T, out=out)
        if chunk < n:
            y[:, first : first + part.out_features] = out


def _matmul(x: torch.Tensor, packed: PackedWeight, path: str | None) -> torch.Tensor:
    _check_input(x, packed)
    flat = x.reshape(-1, packed.in_features)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m, n = flat.shape[0], packed.out_features
    path = path or matmul_path(m)
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}: expected one of {', '.join(PATHS)}")
    if path == "gemv" and m > DECODE_MAX_ROWS:
        raise ValueError(f"the GEMV takes at most {DECODE_MAX_ROWS} rows, got {m}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    if path == "dequant":
        _dequantized_matmul(flat, packed, y)
        return y.reshape(*x.shape[:-1], n)
    dummy = packed.words
    args = (
        flat, packed.words, packed.scales,
        dummy if packed.zeros is None else packed.zeros,
        dummy if packed.perm is None else packed.perm,
        dummy if packed.bias is None else packed.bias,
        y, m, n, packed.in_features, packed.words.shape[1], packed.n_blocks, flat.stride(0), y.stride(0),
    )  # fmt: skip
    flags = dict(
        BITS=packed.bits,
        C=packed.block,
        ZERO=packed.zero,
        HAS_PERM=packed.perm is not None,
        HAS_BIAS=packed.bias is not None,
    )
    if path == "gemv":
        _launch_gemv(args, flags, m, n, x.device)
    else:
        _launch_gemm(args, flags, m, n)
    return y.reshape(*x.shape[:-1], n)


def w4a16_matmul(x: torch.Tensor, packed: PackedWeight, path: str | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a ``prepare_w4a16`` weight; any leading shape, fp16/bf16 in and out.

    ``path`` (default ``matmul_path(rows)``): ``"gemv"`` up to ``DECODE_MAX_ROWS`` rows, ``"gemm"``
    the fused tiled GEMM, ``"dequant"`` the weight dequantized once, then cuBLAS.
    """
    if packed.bits != 4:
        raise ValueError(f"w4a16_matmul needs a 4-bit weight, got {packed.bits} bits")
    return _matmul(x, packed, path)


def w8a16_matmul(x: torch.Tensor, packed: PackedWeight, path: str | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a ``prepare_w8a16`` weight; see ``w4a16_matmul``."""
    if packed.bits != 8:
        raise ValueError(f"w8a16_matmul needs an 8-bit weight, got {packed.bits} bits")
    return _matmul(x, packed, path)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis; with ``residual``, returns ``(rms_norm(x + residual), x + residual)``."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {hidden}")
    flat = x.reshape(-1, hidden).contiguous()
    res = None if residual is None else residual.reshape(-1, hidden).contiguous()
    y = torch.empty_like(flat)
    h = torch.empty_like(flat) if res is not None else flat
    block = triton.next_power_of_2(hidden)
    warps = min(16, max(1, block // 256))
    _rms_norm_kernel[(flat.shape[0],)](
        flat, flat if res is None else res, weight, y, h, hidden,
        flat.stride(0), h.stride(0) if res is None else res.stride(0), y.stride(0), h.stride(0), eps,
        HAS_RESIDUAL=res is not None, BLOCK=block, num_warps=warps,
    )  # fmt: skip
    if res is None:
        return y.reshape(x.shape)
    return y.reshape(x.shape), h.reshape(x.shape)
