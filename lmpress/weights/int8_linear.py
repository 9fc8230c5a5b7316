"""W8A8 execution: int8 per-channel weights, dynamic per-token int8 activations, int8 matrix multiplication.

Xiao, Lin, Seznec, Wu, Demouth, Han, "SmoothQuant: Accurate and Efficient
Post-Training Quantization for Large Language Models" (ICML 2023,
arXiv:2211.10438), §2: with per-token activation scales ``Δ_X`` (one per row of
X) and per-output-channel weight scales ``Δ_W`` (one per row of W),

    Y = X Wᵀ ≈ diag(Δ_X) · (X̄ W̄ᵀ) · diag(Δ_W)

where ``X̄ = round(X / Δ_X)`` and ``W̄`` are int8: the product ``X̄ W̄ᵀ`` is one int8
GEMM accumulating in int32 (``torch._int_mm``, on CPU and CUDA), and both scales
factor out of the sum, which is why the weights must have one scale per output
row (no groups along the input axis).

The weights come from lmpress's 8-bit symmetric per-channel grid (``scheme.py``):
codes ``q`` in [0, 255] with zero 128, so ``q - 128`` is the int8 weight and the
row scale is unchanged. Activations use the symmetric per-token grid
``Δ_X = max|x| / 127``, codes in [-127, 127].

``torch._int_mm`` on CUDA needs more than 16 rows and K, N multiples of 8; on
CPU it takes any shape. :func:`int8_matmul` pads the rows of a decode-sized
input to 32 on CUDA (the padding is zeros and is sliced away) and refuses K or N
that are not multiples of 8 there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

INT8_MAX = 127
CUDA_MIN_ROWS = 17  # torch._int_mm on CUDA: M > 16
CUDA_PAD_ROWS = 32

# codes (out, in) uint8 and scales (out, 1) -> the layer's float32 product of (rows, in) float32 inputs, or None
CpuW8A8Kernel = Callable[[torch.Tensor, torch.Tensor], Callable[[torch.Tensor], torch.Tensor] | None]
_cpu_kernels: list[CpuW8A8Kernel] = []


def register_cpu_w8a8_kernel(kernel: CpuW8A8Kernel) -> CpuW8A8Kernel:
    """Register a CPU execution of the W8A8 function that gives ``w8a8_linear``'s bits, faster than ``_int_mm`` (the
    runtime's C++ kernels register theirs when imported: this unit sits below them). A decorator."""
    _cpu_kernels.append(kernel)
    return kernel


def cpu_w8a8_product(codes: torch.Tensor, scales: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The first registered CPU kernel's product for these 8-bit codes (zero 128) and row scales, or None."""
    for kernel in _cpu_kernels:
        product = kernel(codes, scales)
        if product is not None:
            return product
    return None


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric dynamic int8 quantization of each row of ``x`` (shape ``(..., K)``).

    Returns the int8 codes (same shape) and the float32 scale of each row, shape ``(..., 1)``:
    ``x ≈ codes * scale`` with ``scale = max|x_row| / 127`` (an all-zero row gets scale 1).
    """
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """What per-token int8 quantization leaves of ``x``, in ``x``'s dtype (simulation, searches)."""
    codes, scale = quantize_per_token(x)
    return (codes.float() * scale).to(x.dtype)


def int8_weight(codes: torch.Tensor) -> torch.Tensor:
    """lmpress's 8-bit symmetric codes (uint8, zero 128) as signed int8 weights ``q - 128``."""
    return (codes.to(torch.int16) - 128).to(torch.int8)


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for int8 ``a`` (M, K) and ``b`` (K, N), accumulated exactly in int32 (``torch._int_mm``).

    On CUDA, inputs of at most 16 rows are padded with zero rows (the kernel needs M > 16).
    """
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8_matmul takes int8 matrices, got {a.dtype} and {b.dtype}")
    if a.device.type == "cuda":
        k, n = b.shape
        if k % 8 or n % 8:
            raise ValueError(f"torch._int_mm on CUDA needs K and N multiples of 8, got K={k}, N={n}")
        rows = a.shape[0]
        if rows < CUDA_MIN_ROWS:
            padded = torch.zeros(CUDA_PAD_ROWS, a.shape[1], dtype=torch.int8, device=a.device)
            padded[:rows] = a
            return torch._int_mm(padded, b)[:rows]
    return torch._int_mm(a.contiguous(), b)


def w8a8_linear(
    x: torch.Tensor, weight_t: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``y = x Wᵀ + b`` with W8A8: ``x`` quantized per token, one int8 GEMM, both scales applied after (§2).

    ``weight_t``: the int8 weight transposed, ``(in, out)``; ``weight_scale``: float32 ``(out,)``.
    The result has ``x``'s dtype and leading shape.
    """
    flat = x.reshape(-1, weight_t.shape[0])
    codes, scale = quantize_per_token(flat)
    acc = int8_matmul(codes, weight_t)
    return w8a8_output(acc.float().mul_(scale).mul_(weight_scale.float()), x, bias)


def w8a8_output(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A W8A8 product's float32 rows ``y`` ``(rows, out)`` as the layer returns them: plus ``bias`` in float32,
    then ``x``'s dtype and leading shape."""
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def w8a8_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The same W8A8 function simulated in float64 (fake-quantized activations times dequantized weights)."""
    codes, scale = quantize_per_token(x.reshape(-1, weight.shape[1]))
    w = weight.double() * weight_scale.double()[:, None]
    y = (codes.double() * scale.double()) @ w.T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``approx`` against ``reference`` in dB."""
    reference, approx = reference.double(), approx.double()
    noise = (reference - approx).pow(2).sum().clamp(min=1e-300)
    return float(10 * torch.log10(reference.pow(2).sum() / noise))
