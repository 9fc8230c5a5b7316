"""Matmul and norm kernels for quantized weights, one module per device (cpu.py, triton.py)."""
