"""The blockwise Hadamard transform on a GPU, in one Triton launch: the CUDA path of ``fwht.blockwise_hadamard``.

Each block of ``b`` values becomes ``H_b x / sqrt(b)`` (Sylvester's order). Rather than ``log2 b`` butterfly stages,
each one a pass and a launch when eager, the kernel multiplies by the +-1 matrix with ``tl.dot``:

- ``b <= 128``: a tile of ``ROWS`` blocks times ``H_b`` (``ROWS x b`` by ``b x b``);
- ``b >= 256``: Sylvester's ``H_b = H_b1 (x) H_b2`` with ``b = b1 * b2``, so a block read as the row-major
  ``b1 x b2`` matrix ``X`` becomes ``H_b1 X H_b2`` (both factors symmetric), one block per program.

Every product is float32 (``input_precision="ieee"``: TF32 would round the input to 10 bits), and the +-1 entries
are exact, so the only roundings are float32 sums, as in the butterfly; the result is cast back to the input's
dtype. Blocks of 2, 4 and 8 (below ``tl.dot``'s smallest tile) are the caller's to run by the butterfly.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

MIN_BLOCK = 16  # tl.dot's smallest tile side
SMALL_BLOCK = 128  # up to this, one H_b per tile of blocks; past it, two Kronecker factors
TILE_ROWS = 16  # blocks per program in the small case
MAX_FACTOR = 64  # b1's largest size: H_b1 and X's tile stay small in registers


@triton.jit
def _small_kernel(x_ptr, h_ptr, y_ptr, n_blocks, scale, B: tl.constexpr, ROWS: tl.constexpr):
    """Rows ``[pid * ROWS, ...)`` of the ``(n_blocks, B)`` matrix of blocks, each times ``H_B`` and ``scale``."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, B)
    at = rows[:, None] * B + cols[None, :]
    mask = (rows < n_blocks)[:, None]
    x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + cols[:, None] * B + cols[None, :])
    y = tl.dot(x, h, input_precision="ieee") * scale
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kronecker_kernel(x_ptr, h1_ptr, h2_ptr, y_ptr, scale, B1: tl.constexpr, B2: tl.constexpr):
    """Block ``pid`` read as the ``B1 x B2`` matrix X: ``H_B1 X H_B2`` times ``scale``."""
    r1, r2 = tl.arange(0, B1), tl.arange(0, B2)
    at = tl.program_id(0).to(tl.int64) * (B1 * B2) + r1[:, None] * B2 + r2[None, :]
    x = tl.load(x_ptr + at).to(tl.float32)
    h1 = tl.load(h1_ptr + r1[:, None] * B1 + r1[None, :])
    h2 = tl.load(h2_ptr + r2[:, None] * B2 + r2[None, :])
    y = tl.dot(h1, tl.dot(x, h2, input_precision="ieee"), input_precision="ieee") * scale
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty))


_SIGNS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _signs(order: int, device: torch.device) -> torch.Tensor:
    """The +-1 Sylvester matrix of ``order`` as float32 on ``device``, built there once per order and device (no
    copy from the host: a first call inside a CUDA graph's capture stays legal)."""
    key = (order, device)
    if key not in _SIGNS:
        h = torch.ones(1, 1, device=device)
        while h.shape[0] < order:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        _SIGNS[key] = h.contiguous()
    return _SIGNS[key]


def factors(block: int) -> tuple[int, int]:
    """``(b1, b2)`` with ``block = b1 * b2``, both at least ``MIN_BLOCK``, ``b1 <= MAX_FACTOR``."""
    b1 = min(MAX_FACTOR, block // MIN_BLOCK)
    return b1, block // b1


def fits(block: int) -> bool:
    """Whether the kernel takes blocks of ``block`` (a power of two of at least ``MIN_BLOCK``)."""
    return block >= MIN_BLOCK and not block & (block - 1)


def hadamard_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x``'s last dimension turned by ``H_block / sqrt(block)`` in each block of ``block``, in ``x``'s dtype."""
    if not fits(block) or x.shape[-1] % block:
        raise ValueError(f"hadamard_blocks: blocks of {block} (a power of two >= {MIN_BLOCK}) over {x.shape[-1]}")
    x = x.contiguous()
    y = torch.empty_like(x)
    n_blocks = x.numel() // block
    scale = 1.0 / math.sqrt(block)
    if n_blocks == 0:
        return y
    if block <= SMALL_BLOCK:
        grid = (triton.cdiv(n_blocks, TILE_ROWS),)
        _small_kernel[grid](x, _signs(block, x.device), y, n_blocks, scale, B=block, ROWS=TILE_ROWS)
    else:
        b1, b2 = factors(block)
        _kronecker_kernel[(n_blocks,)](x, _signs(b1, x.device), _signs(b2, x.device), y, scale, B1=b1, B2=b2)
    return y
