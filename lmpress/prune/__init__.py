"""Pruning: magnitude, Wanda and SparseGPT (unstructured, N:M) on the calibration engine, and
structured pruning (attention heads, MLP channels, whole decoder layers) into a smaller dense model."""
