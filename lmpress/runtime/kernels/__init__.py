"""Matmul kernels for quantized weights, one module per device."""
