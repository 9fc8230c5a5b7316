"""A Triton kernel over ``triton_attention._entries_f32`` alone, for tests/runtime/test_triton_attention.py (a
kernel's helpers must be globals of its module; import this after ``TRITON_INTERPRET`` is set)."""

import triton
import triton.language as tl

from lmpress.runtime.kernels.triton_attention import _entries_f32


@triton.jit
def decode(codes_ptr, out_ptr, N: tl.constexpr):
    at = tl.arange(0, N)
    tl.store(out_ptr + at, _entries_f32(tl.load(codes_ptr + at), True))
