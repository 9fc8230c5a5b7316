"""``lmpress inspect ARTIFACT``: what a checkpoint holds, read back from disk.

``inspect_artifact`` accepts a checkpoint directory (GPTQ, AWQ, compressed-tensors
or a dense Hugging Face checkpoint) or a run's output directory (one checkpoint
per subdirectory, plus manifest.json); ``inspect_render.render_inspect`` turns the result into
rich tables. Quantized checkpoints are decoded by lmpress's readers, so a
damaged file is reported here as it would be on load.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from lmpress.checkpoint_files import (
    CONFIG_NAME,
    quant_method,
    quantized_format,
    read_config,
    read_tensor_headers,
    read_tensors,
)
from lmpress.errors import LmpressInputError
from lmpress.export.artifact_checks import (
    check_artifact,
    check_checkpoint,
    check_gguf,
    gguf_field,
    single_export_file,
)
from lmpress.export.consumers import (
    VLLM_VERSION,
    vllm_fp4_note,
    vllm_kv_cache_note,
    vllm_refusal,
    vllm_w4a8_note,
)
from lmpress.export.kv_cache_tensors import read_kv_quant
from lmpress.export.manifest import verify_artifact
from lmpress.prune.masks import nm_pattern
from lmpress.weights.kv_quant import cache_bytes_per_token
from lmpress.weights.online_rotation import describe_transform_config

MANIFEST = "manifest.json"


def _size_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _single_or_list(values: list[Any]) -> Any:
    distinct = sorted(set(values), key=str)
    return distinct[0] if len(distinct) == 1 else distinct


def _kv_cache_info(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The static KV cache a compressed-tensors checkpoint records: its scheme and bytes per token."""
    layers = config.get("num_hidden_layers", 0)
    kv = read_kv_quant(config.get("quantization_config"), tensors.__getitem__, layers)
    if kv is None:
        return {}
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    per_token = cache_bytes_per_token(kv.scheme, layers, kv_heads, head_dim, head_dim, 1)
    bf16 = cache_bytes_per_token(None, layers, kv_heads, head_dim, head_dim, 2)
    return {"kv_cache": f"{kv.describe()}: {per_token:,.0f} bytes per token ({per_token / bf16:.2f}x bf16)"}


def _inspect_checkpoint(path: Path, zero_counts: bool = True) -> dict[str, Any]:
    """``inspect_artifact``'s summary of a checkpoint directory; ``zero_counts``: dequantize each layer to count
    its zero weights and find its N:M pattern (what the format's settings need not)."""
    config = read_config(path)
    method = quant_method(config)
    info: dict[str, Any] = {
        "path": str(path),
        "size_bytes": _size_on_disk(path),
        "architecture": (config.get("architectures") or [config.get("model_type", "?")])[0],
    }
    if method is None:
        headers = read_tensor_headers(path)
        sparse = _dense_layer_sparsity(path, config, headers)
        info |= {
            "format": "hf",
            "quantized_layers": 0,
            "parameters": sum(math.prod(shape) for _, shape in headers.values()),
            "dtypes": _single_or_list([dtype for dtype, _ in headers.values()]),
            "layers": [],
            "sparse_layers": sparse,
        }
        if sparse:
            info["sparsity"] = _overall_sparsity(sparse)
        return info
    fmt = quantized_format(path, config)
    tensors = read_tensors(path)
    qc = config["quantization_config"]
    layers = fmt.read(config, tensors)
    info |= _kv_cache_info(config, tensors)
    rows = []
    for name, qw in layers.items():
        stored = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.rpartition(".")[0] == name)
        rows.append(_layer_row(name, qw, stored, zero_counts))
    info |= {"format": "compressed-tensors" if method == "compressed-tensors" else method} | _layers_summary(rows)
    info["other_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values()) - info["quantized_bytes"]
    if rows and zero_counts:
        info["sparsity"] = _overall_sparsity(rows)
    if method == "gptq":
        info["checkpoint_format"] = qc.get("checkpoint_format", "gptq")
    if method == "awq":
        info["version"] = qc.get("version", "gemm")
    if method == "compressed-tensors":
        info["ct_format"] = qc.get("format")
        info["online_rotations"] = describe_transform_config(qc.get("transform_config"))
    return info


def _layer_row(name: str, qw: Any, stored: int, zero_counts: bool = True) -> dict[str, Any]:
    """A quantized layer's row of ``inspect``'s table: ``qw`` its weight as a reader gives it, ``stored`` the bytes
    of its tensors in the file; ``zero_counts``: dequantize it to count its zero weights and find its N:M pattern."""
    codes = getattr(qw, "qweight", None)
    out_features, in_features = (codes if codes is not None else qw.codes).shape
    weight = qw.dequantize(torch.float32) if zero_counts else None
    return (
        {
            "name": name,
            "shape": [out_features, in_features],
            "bits": qw.scheme.bits,
            "group_size": qw.scheme.group_size,
            "sym": qw.scheme.symmetric,
            "activations": qw.scheme.activations or "float",
            "act_order": qw.g_idx is not None,
            "bytes": stored,
            "bits_per_weight": round(8 * stored / (out_features * in_features), 3),
        }
        | ({"sparsity": float((weight == 0).float().mean()), "pattern": nm_pattern(weight)} if zero_counts else {})
        | _fp4_fields(qw.scheme)
    )


def _layers_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What every quantized layer's row shares (a list where they differ), their weights and bytes, the rows."""
    quantized_bytes = sum(r["bytes"] for r in rows)
    quantized_weights = sum(r["shape"][0] * r["shape"][1] for r in rows)
    return {
        "quantized_layers": len(rows),
        "bits": _single_or_list([r["bits"] for r in rows]) if rows else None,
        "group_size": _single_or_list([r["group_size"] for r in rows]) if rows else None,
        "sym": _single_or_list([r["sym"] for r in rows]) if rows else None,
        "activations": _single_or_list([r["activations"] for r in rows]) if rows else None,
        "act_order": any(r["act_order"] for r in rows),
        "fp4": _single_or_list([r["fp4"] for r in rows if "fp4" in r]) if any("fp4" in r for r in rows) else None,
        "quantized_weights": quantized_weights,
        "quantized_bytes": quantized_bytes,
        "layers": rows,
    }


def onnx_summary(file: Path) -> dict[str, Any]:
    """An ONNX export's architecture, size with its external data, and one row per MatMulNBits layer (decoded to
    count its zeros, as a checkpoint's are)."""
    import onnx

    from lmpress.export.onnx import initializer_bytes, read_onnx_proto

    proto = onnx.load(str(file))  # once, for the tensors and their stored sizes
    values, tensors = read_onnx_proto(file, proto)
    stored = initializer_bytes(proto)
    rows = []
    for name, qw in tensors.items():
        if hasattr(qw, "scheme"):  # a MatMulNBits layer's QuantizedWeight
            prefixes = (f"{name}.MatMulNBits.", f"{name}.input_order")
            rows.append(_layer_row(name, qw, sum(b for k, b in stored.items() if k.startswith(prefixes)), True))
    info = {
        "architecture": (values.get("architectures") or [values.get("model_type", "?")])[0],
        "size_bytes": sum(p.stat().st_size for p in file.parent.glob(f"{file.name}*") if p.is_file()),
    } | _layers_summary(rows)
    info["other_bytes"] = sum(stored.values()) - info["quantized_bytes"]
    if rows:
        info["sparsity"] = _overall_sparsity(rows)
    return info


# How each FP4 grid stores its block scales (lmpress.weights.fp4)
SCALE_ENCODINGS = {"nvfp4": "E4M3 / global float32", "mxfp4": "E8M0"}


def _fp4_fields(scheme: Any) -> dict[str, Any]:
    """An FP4 layer's format and block-scale encoding (nothing for integer layers)."""
    if getattr(scheme, "fp4", None) is None:
        return {}
    return {"fp4": scheme.fp4, "scale_encoding": SCALE_ENCODINGS[scheme.fp4]}


def _dense_layer_sparsity(path: Path, config: dict[str, Any], headers: dict) -> list[dict[str, Any]]:
    """Per decoder-layer linear weight of a dense checkpoint: its shape, fraction of zeros and N:M pattern."""
    names = [k for k, (_, shape) in headers.items() if len(shape) == 2 and k.endswith(".weight") and ".layers." in k]
    if not names:
        return []
    tensors = read_tensors(path)
    rows = []
    for key in names:
        weight = tensors[key].float()
        rows.append(
            {
                "name": key.removesuffix(".weight"),
                "shape": list(weight.shape),
                "sparsity": float((weight == 0).float().mean()),
                "pattern": nm_pattern(weight),
            }
        )
    return rows


def _overall_sparsity(rows: list[dict[str, Any]]) -> float:
    weights = sum(r["shape"][0] * r["shape"][1] for r in rows)
    return sum(r["sparsity"] * r["shape"][0] * r["shape"][1] for r in rows) / weights


SINGLE_FILE_FORMATS = {".gguf": "gguf", ".onnx": "onnx"}


def _single_file_export(path: Path, verify: bool) -> dict[str, Any] | None:
    """A GGUF or ONNX export (the file, or lmpress's export directory holding it with no config.json), checked:
    its file, size, summary and who serves it; None for anything else."""
    if path.is_dir() and (path / CONFIG_NAME).is_file():
        return None
    file = single_export_file(path)
    if file is None:
        return None
    info = {
        "path": str(file),
        "format": SINGLE_FILE_FORMATS[file.suffix],
        "size_bytes": file.stat().st_size,
        "layers": [],
    }
    if info["format"] == "gguf":
        info |= gguf_summary(check_gguf(file, full=verify))
    else:
        check_artifact(file, full=verify)
        info |= onnx_summary(file)
    return _with_consumers(info)


GGUF_METADATA = ("general.architecture", "general.name", "general.file_type", "{arch}.block_count",
                 "{arch}.context_length", "{arch}.embedding_length", "tokenizer.ggml.model")  # fmt: skip


def gguf_summary(reader: Any) -> dict[str, Any]:
    """A GGUF file's tensor types, bits per weight, block sizes, metadata and one row per tensor (MXFP4 files also
    as ``fp4``)."""
    from gguf.constants import GGML_QUANT_SIZES

    arch = gguf_field(reader, "general.architecture")
    metadata = {}
    for key in (k.format(arch=arch) for k in GGUF_METADATA):
        value = gguf_field(reader, key)
        if value is not None:
            metadata[key] = value
    rows = []
    for t in reader.tensors:
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        rows.append(
            {
                "name": t.name,
                "type": t.tensor_type.name,
                "shape": [int(n) for n in reversed(t.shape)],  # GGUF lists the innermost dimension first
                "block_size": block,
                "bytes": int(t.n_elements) // block * type_size,
                "bits_per_weight": round(8 * type_size / block, 3),
            }
        )
    types = [r["type"] for r in rows]
    counts = {name: types.count(name) for name in sorted(set(types))}
    quantized = [r for r in rows if r["block_size"] > 1]
    info: dict[str, Any] = {
        "tensor_types": counts,
        "metadata": metadata,
        "gguf_tensors": sorted(rows, key=lambda r: natural_key(r["name"])),
        "tensors": len(rows),
    }
    if quantized:
        info["bits"] = _single_or_list([r["bits_per_weight"] for r in quantized])
        info["group_size"] = _single_or_list([r["block_size"] for r in quantized])
    if "MXFP4" in counts:
        info |= {"fp4": "mxfp4", "scale_encoding": "E8M0"}
    return info


def natural_key(name: str) -> list[Any]:
    """Sort key that puts ``layers.2`` before ``layers.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _with_consumers(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` with whether vLLM loads the artifact (``lmpress.export.consumers``)."""
    refusal = vllm_refusal(info)
    fp4 = vllm_fp4_note(info) or vllm_w4a8_note(info)
    info["vllm"] = f"refuses: {refusal}" if refusal else fp4 or f"loads ({VLLM_VERSION}, measured)"
    kv = vllm_kv_cache_note(info)
    if kv is not None and not refusal:
        info["vllm"] += f"; {kv}"
    return info


def inspect_artifact(path: str | Path, verify: bool = False) -> dict[str, Any]:
    """Format, bits, group size, symmetry, act-order, size on disk and a per-layer summary of ``path``, after the
    checks of ``lmpress.export.artifact_checks`` (cheap ones always, every weight with ``verify``) and, inside a
    run, its manifest's."""
    path = Path(path)
    if not path.exists():
        raise LmpressInputError(f"{path}: no such file or directory")
    verify_artifact(path, rehash=verify)
    single = _single_file_export(path, verify)
    if single is not None:
        return single
    if path.is_file():
        raise LmpressInputError(
            f"{path}: inspect reads checkpoint directories (gptq, awq, compressed-tensors, hf), GGUF and ONNX "
            "exports, or a run's output"
        )
    if (path / CONFIG_NAME).is_file():
        check_checkpoint(path, full=verify)
        return _with_consumers(_inspect_checkpoint(path))
    children = sorted(p for p in path.iterdir() if p.is_dir() and (p / CONFIG_NAME).is_file())
    singles = [p for p in sorted(path.iterdir()) if p.is_dir() and p not in children and single_export_file(p)]
    if not children and not singles:
        raise LmpressInputError(f"{path}: neither a checkpoint (no {CONFIG_NAME}) nor a run directory with checkpoints")
    artifacts = []
    for child in children:
        check_checkpoint(child, full=verify)
        artifacts.append(_with_consumers(_inspect_checkpoint(child)))
    artifacts += [_single_file_export(child, verify) for child in singles]
    info: dict[str, Any] = {
        "format": "run",
        "path": str(path),
        "size_bytes": _size_on_disk(path),
        "artifacts": artifacts,
    }
    manifest = path / MANIFEST
    if manifest.is_file():
        try:
            info["manifest_files"] = len(json.loads(manifest.read_text()).get("files", []))
        except (json.JSONDecodeError, AttributeError) as e:
            raise LmpressInputError(f"{manifest}: not valid JSON ({e})") from e
    return info


# the exports the README's table names vLLM as a loader of
VLLM_LOADS = ("gptq", "awq", "compressed-tensors")


def consumer_warnings(exports: dict[str, Path]) -> list[dict[str, str]]:
    """One entry (format, consumer, why) for each of a run's exports that a consumer the README names for its format
    cannot load, as ``inspect`` predicts it (``vllm_refusal``)."""
    warnings = []
    for fmt, path in exports.items():
        if fmt in VLLM_LOADS:  # the run checks and reads its exports back next: the format's settings suffice here
            why = vllm_refusal(_inspect_checkpoint(path, zero_counts=False))
            if why:
                warnings.append({"format": fmt, "consumer": "vllm", "why": why})
    return warnings
