"""The runtime's blockwise Hadamard transform (kernels/fwht.py): the CPU op against the torch butterfly (bit for bit)
and a float64 Hadamard matrix, the Triton kernel against the same matrix (under ``TRITON_INTERPRET=1`` without a
GPU), which way each build takes, and the rotated linear inside a compiled step.

Error bounds for the Triton kernel are derived, not tuned: float32 sums of ``b`` terms of ``+-x`` leave a relative
rms error of at most about ``sqrt(b) * 2**-24``; a cast to bfloat16 adds ``u / sqrt(3)`` (``u = 2**-8``, twice
that in the interpreter, which truncates); 3 dB of margin for the sampling spread.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lmpress.runtime.kernels import fwht
from lmpress.runtime.linears import Build, RotatedInputLinear
from lmpress.weights.hadamard import hadamard_matrix
from lmpress.weights.online_rotation import blockwise_hadamard as torch_butterfly

BLOCKS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
MARGIN_DB = 3.0
needs_op = pytest.mark.skipif(not fwht.cpu_op_available(), reason="lmpress's CPU library did not build here")


def dense_reference(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x V`` in float64 by the block-diagonal matrix itself (independent of any butterfly)."""
    lead, n = x.shape[:-1], x.shape[-1]
    blocks = x.double().reshape(*lead, n // block, block)
    return (blocks @ hadamard_matrix(block).T).reshape(*lead, n)


def sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    noise = (got.double() - want).pow(2).sum()
    return float("inf") if noise == 0 else 10 * math.log10(want.pow(2).sum() / noise)


@needs_op
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (2, 5, 3)])  # (rows..., blocks per row)
def test_cpu_op_is_the_torch_butterfly_bit_for_bit(block, shape):
    *rows, per_row = shape
    x = torch.randn(*rows, per_row * block)
    got = torch.ops.lmpress_cpu.hadamard_blocks(x, block)
    assert torch.equal(got, torch_butterfly(x, block))
    assert got.shape == x.shape and got.dtype == torch.float32
    # and it is the transform: float32 sums of b terms, relative rms below sqrt(b) * 2^-24
    assert sqnr_db(got, dense_reference(x, block)) >= -20 * math.log10(math.sqrt(block) * 2**-24) - MARGIN_DB


@needs_op
def test_cpu_op_leaves_its_input_alone_and_takes_a_large_prefill():
    x = torch.randn(2048, 1536)
    before = x.clone()
    got = torch.ops.lmpress_cpu.hadamard_blocks(x, 512)  # split across threads
    assert torch.equal(x, before)
    assert torch.equal(got, torch_butterfly(x, 512))


@needs_op
@pytest.mark.parametrize(
    ("x", "block", "message"),
    [
        (torch.randn(1, 64), 12, "power of two"),
        (torch.randn(1, 64), 1, "power of two"),
        (torch.randn(1, 48), 32, "do not divide"),
        (torch.randn(1, 64).double(), 16, "float32"),
        (torch.randn(64, 2).t(), 16, "contiguous"),
    ],
)
def test_cpu_op_refuses_what_it_cannot_turn(x, block, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.lmpress_cpu.hadamard_blocks(x, block)


def test_each_build_takes_its_way():
    op = "cpu-op" if fwht.cpu_op_available() else "torch"
    assert Build(torch.float32, "cpu").rotation_path(512) == op
    assert Build(torch.bfloat16, "cpu").rotation_path(512) == "torch"  # the op is float32's
    assert Build(torch.float32, "reference").rotation_path(512) == "torch"  # the model's own hooks, unchanged
    triton = "triton" if fwht.triton_installed() else "torch"
    assert Build(torch.bfloat16, "cuda").rotation_path(512) == triton
    assert Build(torch.float16, "triton").rotation_path(16) == triton
    assert Build(torch.bfloat16, "cuda").rotation_path(8) == "torch"  # below tl.dot's tile


@needs_op
def test_a_rotated_linear_compiles_in_one_graph_with_the_op():
    torch.manual_seed(0)
    layer = RotatedInputLinear(512, torch.nn.Linear(1536, 64), Build(torch.float32).rotation_path(512))
    x = torch.randn(1, 1536)
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), layer(x))
        assert torch.equal(layer(x), layer.linear(torch_butterfly(x, 512)))


needs_triton = pytest.mark.skipif(not fwht.triton_installed(), reason="triton is not installed (lmpress[dev])")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"


@needs_triton
@pytest.mark.parametrize("block", [b for b in BLOCKS if b >= fwht.TRITON_MIN_BLOCK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_against_the_matrix(block, dtype):
    from lmpress.runtime.kernels import triton_fwht

    torch.manual_seed(block)
    rows = 1 if block >= 1024 else 3  # the interpreter is slow; a decode row for the large blocks
    x = torch.randn(rows, 2 * block, device=DEVICE).to(dtype)
    got = triton_fwht.hadamard_blocks(x, block)
    assert got.dtype == dtype and got.shape == x.shape and got.device == x.device
    sums = (math.sqrt(block) * 2**-24) ** 2
    cast = 0.0 if dtype == torch.float32 else (2**-8 * (2 if INTERPRETED else 1)) ** 2 / 3
    bound = -10 * math.log10(sums + cast) - MARGIN_DB
    assert sqnr_db(got.cpu(), dense_reference(x.cpu().float(), block)) >= bound


@needs_triton
def test_triton_kernel_refuses_blocks_below_its_tile():
    from lmpress.runtime.kernels import triton_fwht

    with pytest.raises(ValueError, match="power of two >= 16"):
        triton_fwht.hadamard_blocks(torch.randn(1, 64, device=DEVICE), 8)


@needs_triton
def test_triton_factors_cover_every_large_block():
    from lmpress.runtime.kernels import triton_fwht

    for block in (256, 512, 1024, 2048, 4096, 8192, 16384):
        b1, b2 = triton_fwht.factors(block)
        assert b1 * b2 == block and min(b1, b2) >= triton_fwht.MIN_BLOCK and b1 <= triton_fwht.MAX_FACTOR
