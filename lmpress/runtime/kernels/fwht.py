"""The runtime's online rotations, ``x V`` for ``V`` the block-diagonal Hadamard matrix of ``online_rotation.py``
(R4 before ``down_proj``; the rotate stage's input blocks before every linear): by the fastest way on the input's
device.

- CPU, float32: ``torch.ops.lmpress_cpu.hadamard_blocks`` (``cpu_hadamard.cpp``), the butterfly in one call; its
  output equals the torch butterfly's (``online_rotation.blockwise_hadamard``, which the evaluator's hooks run) bit
  for bit. SmolLM2's R4 input (1,536 values, blocks of 512) on one thread: about 2 us against 215 us eager
  (``bench/fwht.py``).
- CUDA: one Triton launch (``triton_fwht.py``, the ``lmpress::triton_hadamard_blocks`` custom op, opaque to
  ``torch.compile`` and captured by CUDA graphs) for blocks of 16 and more.
- Otherwise (other dtypes on the CPU, blocks below 16 on a GPU, no Triton, no C++ build) the torch butterfly.

The way is chosen when the model is built (``rotation_path``), not per call: a compiled step must not trace the
library's build check.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from lmpress.runtime.kernels import cpu_int
from lmpress.weights.online_rotation import blockwise_hadamard as torch_blockwise_hadamard

TRITON_MIN_BLOCK = 16  # tl.dot's smallest tile side (triton_fwht.MIN_BLOCK)


@functools.cache
def cpu_op_available() -> bool:
    """Whether lmpress's CPU library (with ``hadamard_blocks``) is built and loaded here (building it if needed)."""
    return cpu_int.available() and hasattr(torch.ops.lmpress_cpu, "hadamard_blocks")


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


PATHS = ("cpu-op", "triton", "torch")


def rotation_path(device_type: str, dtype: torch.dtype, block: int) -> str:
    """Which of ``PATHS`` turns an input on ``device_type`` in ``dtype`` by blocks of ``block``."""
    if device_type == "cpu" and dtype == torch.float32 and cpu_op_available():
        return "cpu-op"
    if device_type == "cuda" and block >= TRITON_MIN_BLOCK and triton_installed():
        return "triton"
    return "torch"


@torch.library.custom_op("lmpress::triton_hadamard_blocks", mutates_args=())
def triton_hadamard_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x V`` by the Triton kernel (``triton_fwht.hadamard_blocks``)."""
    from lmpress.runtime.kernels import triton_fwht

    return triton_fwht.hadamard_blocks(x, block)


@triton_hadamard_blocks.register_fake
def _(x, block) -> torch.Tensor:
    return torch.empty_like(x)


def blockwise_hadamard(x: torch.Tensor, block: int, path: str) -> torch.Tensor:
    """``x V`` over the last dimension, blocks of ``block`` (a power of two dividing it), in ``x``'s dtype, by
    ``path`` (``rotation_path``'s choice for ``x``'s device and dtype)."""
    if path == "cpu-op":
        return torch.ops.lmpress_cpu.hadamard_blocks(x.contiguous(), block)
    if path == "triton":
        return triton_hadamard_blocks(x.contiguous(), block)
    return torch_blockwise_hadamard(x, block)
