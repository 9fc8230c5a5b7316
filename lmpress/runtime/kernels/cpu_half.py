"""Float32 layers whose weights stay bfloat16 or float16, as a checkpoint stores them (``cpu_half.cpp``).

A half-precision weight widens to float32 exactly, so a float32 CPU build widening it (as the runtime did) gains no
precision and reads twice the bytes per decode step: SmolLM2's tied head is 113 MB a token in float32, 57 MB in
bfloat16. ``HalfWeightLinear`` keeps the weight as stored and multiplies up to ``FEW_ROWS`` float32 input rows by
it with ``torch.ops.lmpress_cpu.half_linear`` (float32 products and sums, AVX-512 or AVX2); more rows (a prefill) run
``F.linear`` on the weight widened for the call, a block of rows at a time. The activations stay float32
throughout, unlike a bfloat16 build.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from lmpress.runtime.kernels import cpu_int

COLUMNS = 32  # in_features must be a multiple of it (fixed in cpu_half.cpp)
HALF_DTYPES = (torch.bfloat16, torch.float16)
DEFAULT_PREFETCH = 4608  # bytes ahead of each weight load: cpu_half.cpp's PREFETCH_BYTES, the op's default
ROWS_PER_PASS = (4, 1)  # weight rows the op dots at once (its ``rows``), its default first


@functools.cache
def available() -> bool:
    """Whether the op is built and this CPU runs it (AVX2 or AVX-512: ``cpu_int.host_isa() >= 1``)."""
    return cpu_int.available() and cpu_int.host_isa() >= 1 and hasattr(torch.ops.lmpress_cpu, "half_linear")


def fits(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a layer with float ``weight`` in a ``dtype`` build on the CPU keeps it as stored, for the op."""
    return dtype == torch.float32 and weight.dtype in HALF_DTYPES and weight.shape[-1] % COLUMNS == 0 and available()


class HalfWeightLinear(nn.Module):
    """``x @ weight.T + bias`` for float32 ``x``, the weight kept bfloat16 or float16 and the bias float32."""

    FEW_ROWS = 16  # up to this many rows run the op (one pass over the weight per 4 rows); more widen the weight
    WIDENED_BYTES = 64 * 2**20  # ... a block of its rows at a time, this large at most (an 8B head widened whole: 2 GB)

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        isa: int | None = None,
        prefetch: int | None = None,
        rows: int | None = None,
    ) -> None:
        """``isa`` (default: the host's best level), ``prefetch`` (bytes ahead; default ``DEFAULT_PREFETCH``) and
        ``rows`` (weight rows dotted at once, one of ``ROWS_PER_PASS``; the same outputs either way) choose the op's
        variant: the runtime passes this host's probed choice (``cpu_probe.choose_half_kernel``)."""
        super().__init__()
        usable = available() and weight.dtype in HALF_DTYPES  # else F.linear on the weight widened for every call
        self.out_features, self.in_features = weight.shape
        # Large weights are copied into huge pages, as the int8 kernels' are (cpu_int.huge_pages: fewer TLB misses
        # while a step streams them); smaller ones are used as given.
        self.weight = nn.Parameter(cpu_int.huge_pages(weight.detach()), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.isa = 0 if not usable else cpu_int.host_isa() if isa is None else isa  # the op's: 2 AVX-512, 1 AVX2
        self.prefetch = DEFAULT_PREFETCH if prefetch is None else prefetch
        self.rows = ROWS_PER_PASS[0] if rows is None else rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > self.FEW_ROWS or x.device.type != "cpu":
            block = max(1, self.WIDENED_BYTES // (4 * self.in_features))
            y = torch.cat([F.linear(flat, rows.float()) for rows in self.weight.split(block)], dim=-1)
        else:
            y = torch.ops.lmpress_cpu.half_linear(flat.contiguous(), self.weight, self.isa, self.prefetch, self.rows)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)
