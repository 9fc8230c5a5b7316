"""compressed-tensors ``pack-quantized`` checkpoints, as llm-compressor writes them and vLLM reads them.

Per quantized layer ``L`` (see ``weights/pack.py`` for the bit layout):

- ``L.weight_packed`` int32 ``(out, ceil(in*bits/32))``: codes packed along the input axis;
- ``L.weight_scale`` ``(out, n_groups)`` in the scales' dtype (float32 from lmpress's quantizers);
- ``L.weight_zero_point`` int32 ``(ceil(out*bits/32), n_groups)``: asymmetric layers only;
- ``L.weight_shape`` int64 ``[out, in]``;
- ``L.bias`` where the layer has one.

compressed-tensors codes are signed (``c - 2**(bits-1)``), with symmetric layers'
zero point 0: lmpress's symmetric zero ``2**(bits-1)`` is that same point.
``quantization_config`` has one config group per distinct scheme: ``targets:
["Linear"]`` with the float linears in ``ignore`` when the whole model uses one
scheme, explicit module names otherwise. compressed-tensors dropped act-order
``g_idx`` (``actorder: group``), so act-order layers cannot be written here.

Pruned layers: the N:M zeros stay inside the packed codes (the weights are stored
dense), and ``sparsity_config`` is empty: vLLM (0.32) refuses any checkpoint whose
``sparsity_config`` names targets ("Sparsity support has been removed from
compressed-tensors"), and compressed-tensors 0.20 decompresses no sparse layout, so
no current consumer reads that record. ``lmpress inspect`` finds each layer's N:M
pattern in its weights.

W8A8 layers (``scheme.activations == "int8"``, from SmoothQuant) are written as
llm-compressor writes W8A8 checkpoints, in the ``int-quantized`` format: the signed
int8 weight as ``L.weight`` (``q - 128``), ``L.weight_scale`` float32 ``(out, 1)``,
and the config group's ``input_activations`` saying int8, symmetric, per token,
dynamic. FP8 layers (``Fp8Linear``, from the ``fp8`` stage) are written in the
``float-quantized`` format: ``L.weight`` float8_e4m3fn, ``L.weight_scale`` float32
``(out, 1)`` (channel strategy) or ``(1,)`` (tensor), input activations float8
per token, dynamic. FP4 layers (``Fp4Linear``: NVFP4, MXFP4) are written as
``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` (``fp4_tensors.py``). A checkpoint
mixing formats has format ``mixed-precision`` (each config group names its own).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmpress.checkpoint_files import check_shape, group_count, require_tensor
from lmpress.errors import LmpressInputError
from lmpress.export.formats import (
    PlannedLayer,
    act_order_g_idx,
    dense_tensors,
    plan_of,
    quantized_layers,
    require_quantized_layers,
    unquantized_linears,
    write_checkpoint,
)
from lmpress.export.fp4_tensors import (
    FP4_CT_FORMATS,
    FP4_SUFFIXES,
    fp4_group_args,
    fp4_tensors,
    is_fp4_args,
    read_fp4,
)
from lmpress.export.kv_cache_tensors import kv_cache_scheme, kv_scale_tensors
from lmpress.quantize.kv_attention import kv_quant_of
from lmpress.registry import ExportFormat, register_format
from lmpress.weights.float8 import Fp8Linear, Fp8Weight, fp8_layers, require_float8
from lmpress.weights.fp4 import Fp4Linear, Fp4Weight, fp4_layers
from lmpress.weights.int8_linear import int8_weight
from lmpress.weights.online_rotation import transform_config, transform_tensors
from lmpress.weights.pack import (
    PACKABLE_BITS,
    ct_pack_zero_point,
    ct_unpack_weight,
    ct_unpack_zero_point,
    packed_length,
)
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantizedWeight, QuantScheme

FORMAT = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"
INT_QUANTIZED = "int-quantized"
FLOAT_QUANTIZED = "float-quantized"
MIXED = "mixed-precision"
# "weight": an int-quantized layer's int8 weight (only a quantized layer's own tensors are looked up by suffix)
SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight", *FP4_SUFFIXES[2:])
# The version of compressed-tensors whose config layout this writer follows.
CT_CONFIG_VERSION = "0.20.0"


def weight_args(scheme: QuantScheme) -> dict[str, Any]:
    """compressed-tensors ``QuantizationArgs`` of a weight scheme."""
    return {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "group_size": None if scheme.group_size == -1 else scheme.group_size,
        "strategy": "channel" if scheme.group_size == -1 else "group",
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
    }


def fp8_weight_args(strategy: str) -> dict[str, Any]:
    """compressed-tensors ``QuantizationArgs`` of E4M3 weights with ``strategy`` (channel | tensor) scales."""
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": strategy,
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
    }


def activation_args(activations: str | None) -> dict[str, Any] | None:
    """compressed-tensors ``QuantizationArgs`` of the input activations (None for weight-only layers)."""
    if activations is None:
        return None
    if activations not in ("int8", "fp8"):
        raise ValueError(f"no compressed-tensors form for {activations} activations")
    return {
        "num_bits": 8,
        "type": "int" if activations == "int8" else "float",
        "symmetric": True,
        "group_size": None,
        "strategy": "token",
        "dynamic": True,
        "actorder": None,
        "block_structure": None,
        "observer": None,
    }


def layer_format(scheme: QuantScheme) -> str:
    if scheme.fp4 is not None:
        return FP4_CT_FORMATS[scheme.fp4]
    w8a8 = scheme.activations == "int8" and (scheme.bits, scheme.group_size, scheme.symmetric) == (8, -1, True)
    return INT_QUANTIZED if w8a8 else PACK_QUANTIZED  # W4A8: packed codes beside int8 input_activations


def ct_tensors(name: str, module: QuantizedLinear) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one layer.

    QuantizedLinear keeps its codes in exactly the ``weight_packed`` layout, so they are copied, not repacked;
    a W8A8 layer's codes are written unpacked as signed int8 (``int-quantized``).
    """
    if layer_format(module.scheme) == INT_QUANTIZED:
        return {
            f"{name}.weight": int8_weight(module.codes().cpu()),
            f"{name}.weight_scale": module.scales.detach().cpu().float().clone(),
        }
    tensors = {
        f"{name}.weight_packed": module.qweight.detach().cpu().clone(),
        f"{name}.weight_scale": module.scales.detach().cpu().clone(),
        f"{name}.weight_shape": torch.tensor([module.out_features, module.in_features], dtype=torch.int64),
    }
    if not module.scheme.symmetric:
        tensors[f"{name}.weight_zero_point"] = ct_pack_zero_point(module.zeros.cpu(), module.scheme.bits)
    return tensors


def ct_scheme_refusal(scheme: QuantScheme, act_order: bool) -> str | None:
    if scheme.bits not in PACKABLE_BITS:
        return f"{scheme.bits}-bit weights; lmpress packs {PACKABLE_BITS} bits"
    if act_order:
        return "act-order (g_idx), which compressed-tensors no longer stores; set static_groups: true, or export gptq"
    return None


def check_ct_plan(model: nn.Module, plan: dict[str, PlannedLayer]) -> None:
    for name, layer in plan.items():
        reason = ct_scheme_refusal(layer.scheme, act_order=False)
        if reason:
            raise LmpressInputError(f"export {FORMAT}: {name}: {reason}")


def _check_layer(name: str, module: QuantizedLinear) -> None:
    scheme = module.scheme
    if act_order_g_idx(module) is not None:
        raise LmpressInputError(
            f"export {FORMAT}: {name} uses act-order (g_idx), which compressed-tensors no longer stores; "
            "export gptq, or quantize with static groups"
        )
    if scheme.symmetric and not bool((module.zeros == 2 ** (scheme.bits - 1)).all()):
        raise LmpressInputError(f"export {FORMAT}: {name} is marked symmetric but its zeros are not 2**(bits-1)")


def _group_args(key: QuantScheme | str) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """(weights, input_activations, format) of a config group: a QuantScheme, or an FP8 layer's strategy."""
    if isinstance(key, QuantScheme) and key.fp4 is not None:
        return fp4_group_args(key)
    if isinstance(key, QuantScheme):
        return weight_args(key), activation_args(key.activations), layer_format(key)
    return fp8_weight_args(key), activation_args("fp8"), FLOAT_QUANTIZED


def ct_quantization_config(
    model: nn.Module,
    layers: dict[str, QuantizedLinear],
    fp8: dict[str, Fp8Linear] | None = None,
    fp4: dict[str, Fp4Linear] | None = None,
) -> dict[str, Any]:
    by_scheme: dict[QuantScheme | str, list[str]] = {}
    for name, module in (layers | (fp4 or {})).items():
        by_scheme.setdefault(module.scheme, []).append(name)
    for name, module in (fp8 or {}).items():
        by_scheme.setdefault(module.strategy, []).append(name)
    float_linears = unquantized_linears(model)
    if len(by_scheme) == 1:
        groups = [(next(iter(by_scheme)), ["Linear"])]
    else:
        groups = list(by_scheme.items())
    config_groups = {}
    for i, (key, targets) in enumerate(groups):
        weights, activations, fmt = _group_args(key)
        config_groups[f"group_{i}"] = {
            "targets": targets,
            "weights": weights,
            "input_activations": activations,
            "output_activations": None,
            "format": fmt,
        }
    formats = {_group_args(key)[2] for key in by_scheme}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else MIXED,
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": float_linears,
        "kv_cache_scheme": kv_cache_scheme(kv_quant_of(model)),
        "global_compression_ratio": None,
        "sparsity_config": {},  # see the module docstring: vLLM refuses a sparsity_config with targets
        "transform_config": transform_config(model) or {},  # R4's online rotations (online_rotation.py)
        "version": CT_CONFIG_VERSION,
    }


def export_compressed_tensors(model: nn.Module, tokenizer: Any, out_dir: Path) -> None:
    fp8 = fp8_layers(model)  # their buffers already carry the float-quantized names (weight, weight_scale)
    fp4 = fp4_layers(model)  # and theirs the nvfp4/mxfp4-pack-quantized names (weight_packed, weight_scale, ...)
    layers = quantized_layers(model) if fp8 or fp4 else require_quantized_layers(model, FORMAT)
    check_ct_plan(model, plan_of(layers))
    for name, module in layers.items():
        _check_layer(name, module)
    tensors = dense_tensors(model)
    for name, module in layers.items():
        tensors.update(ct_tensors(name, module))
    for name, module in fp4.items():
        tensors.update(fp4_tensors(name, module))
    tensors.update(kv_scale_tensors(model, kv_quant_of(model), model.get_input_embeddings().weight.dtype))
    tensors.update(transform_tensors(model, model.get_input_embeddings().weight.dtype))
    write_checkpoint(out_dir, model, tokenizer, tensors, ct_quantization_config(model, layers, fp8, fp4))


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target


def layer_weight_args(qc: dict[str, Any], name: str) -> dict[str, Any]:
    """The ``weights`` args that apply to layer ``name``: a target naming it beats a class target."""
    if any(_matches(name, pattern) for pattern in qc.get("ignore") or []):
        raise LmpressInputError(f"{FORMAT} checkpoint: {name} has packed weights but is in the ignore list")
    by_class = None
    for group in (qc.get("config_groups") or {}).values():
        weights = group.get("weights")
        if not weights:
            continue
        for target in group.get("targets", []):
            if _matches(name, target):
                return weights
            if not target.startswith("re:") and "." not in target and target[:1].isupper():
                by_class = by_class or weights
    if by_class is None:
        raise LmpressInputError(f"{FORMAT} checkpoint: no config group targets {name}")
    return by_class


def layer_group(qc: dict[str, Any], name: str) -> dict[str, Any]:
    """The config group whose ``weights`` apply to layer ``name`` (see :func:`layer_weight_args`)."""
    weights = layer_weight_args(qc, name)
    return next(g for g in (qc.get("config_groups") or {}).values() if g.get("weights") is weights)


def _activations_of(group: dict[str, Any], name: str) -> str | None:
    args = group.get("input_activations")
    if not args:
        return None
    read = (args.get("type", "int"), args.get("num_bits"), args.get("strategy"), args.get("dynamic"))
    if read != ("int", 8, "token", True) or not args.get("symmetric", True):
        raise LmpressInputError(
            f"{FORMAT} checkpoint: {name} has input activations {read[0]}{read[1]} {read[2]} "
            f"(dynamic: {read[3]}); lmpress runs symmetric int8 per-token dynamic activations"
        )
    return "int8"


def _read_int_quantized(name: str, tensors: dict[str, torch.Tensor], scheme: QuantScheme) -> QuantizedWeight:
    if (scheme.bits, scheme.group_size, scheme.symmetric, scheme.activations) != (8, -1, True, "int8"):
        raise LmpressInputError(
            f"{FORMAT} checkpoint: {name} is {INT_QUANTIZED} with {scheme.describe()}; lmpress reads "
            "8-bit symmetric per-channel weights with int8 per-token activations there"
        )
    weight = require_tensor(tensors, f"{name}.weight", torch.int8)
    if weight.dim() != 2:
        raise LmpressInputError(f"{FORMAT} checkpoint: {name}.weight has shape {tuple(weight.shape)}, expected 2-D")
    scales = require_tensor(tensors, f"{name}.weight_scale")
    check_shape(f"{name}.weight_scale", scales, (weight.shape[0], 1))
    return QuantizedWeight(
        qweight=(weight.to(torch.int16) + 128).to(torch.uint8),
        scales=scales.float().contiguous(),
        zeros=torch.full((weight.shape[0], 1), 128.0),
        scheme=scheme,
    )


def _read_float_quantized(name: str, tensors: dict[str, torch.Tensor], group: dict[str, Any]) -> Fp8Weight:
    weights, activations = group.get("weights") or {}, group.get("input_activations") or {}
    strategy = weights.get("strategy")
    read = (weights.get("type"), weights.get("num_bits"), strategy)
    acts = tuple(activations.get(k) for k in ("type", "num_bits", "strategy", "dynamic"))
    if read not in (("float", 8, "channel"), ("float", 8, "tensor")) or acts != ("float", 8, "token", True):
        raise LmpressInputError(
            f"{FORMAT} checkpoint: {name} is {FLOAT_QUANTIZED} with weights {read} and activations {acts}; lmpress "
            "reads FP8 weights with channel or tensor scales and dynamic per-token FP8 activations"
        )
    weight = require_tensor(tensors, f"{name}.weight", require_float8(f"{FORMAT} checkpoint {name}"))
    scales = require_tensor(tensors, f"{name}.weight_scale")
    expected = (weight.shape[0], 1) if strategy == "channel" else (1,)
    if weight.dim() != 2 or scales.numel() != expected[0]:
        raise LmpressInputError(
            f"{FORMAT} checkpoint: {name}: weight {tuple(weight.shape)} with {scales.numel()} {strategy} scale(s)"
        )
    scales = scales.float().reshape(expected)
    return Fp8Weight(weight, scales, strategy)


def _scheme_of(args: dict[str, Any], name: str) -> QuantScheme:
    if args.get("type", "int") != "int" or args.get("strategy") not in ("group", "channel"):
        raise LmpressInputError(
            f"{FORMAT} checkpoint: {name} uses {args.get('type')} {args.get('strategy')} weights; "
            "lmpress reads int weights with group or channel scales"
        )
    if args.get("actorder") == "group":
        raise LmpressInputError(
            f"{FORMAT} checkpoint: {name} uses act-order group (g_idx), which lmpress does not read"
        )
    group_size = -1 if args["strategy"] == "channel" else int(args["group_size"])
    return QuantScheme(int(args["num_bits"]), group_size, bool(args.get("symmetric", True)))


def read_compressed_tensors(
    config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> dict[str, QuantizedWeight | Fp8Weight | Fp4Weight]:
    qc = config["quantization_config"]
    readable = (PACK_QUANTIZED, INT_QUANTIZED, FLOAT_QUANTIZED, *FP4_CT_FORMATS.values())
    if qc.get("format") not in (*readable, MIXED):
        raise LmpressInputError(
            f"{FORMAT} checkpoint: format {qc.get('format')!r}; lmpress reads {' and '.join(readable)}"
        )
    for group_name, group in (qc.get("config_groups") or {}).items():
        if group.get("format") not in (*readable, None):
            raise LmpressInputError(f"{FORMAT} checkpoint: config group {group_name} is not {' or '.join(readable)}")
    layers = {}
    for key in sorted(k for k in tensors if k.endswith(".weight_scale")):
        name = key.removesuffix(".weight_scale")
        if f"{name}.weight_packed" in tensors:
            continue
        group = layer_group(qc, name)
        if (group.get("format") or qc.get("format")) == FLOAT_QUANTIZED:
            layers[name] = _read_float_quantized(name, tensors, group)
            continue
        if (group.get("format") or qc.get("format")) != INT_QUANTIZED:
            raise LmpressInputError(
                f"{FORMAT} checkpoint: {name} has a weight_scale but neither packed nor int8 weights"
            )
        scheme = _scheme_of(group["weights"], name)
        scheme = QuantScheme(scheme.bits, scheme.group_size, scheme.symmetric, _activations_of(group, name))
        layers[name] = _read_int_quantized(name, tensors, scheme)
    for key in sorted(k for k in tensors if k.endswith(".weight_packed")):
        name = key.removesuffix(".weight_packed")
        group = layer_group(qc, name)
        if is_fp4_args(group.get("weights")):
            layers[name] = read_fp4(name, tensors, group)
            continue
        scheme = _scheme_of(group["weights"], name)
        scheme = QuantScheme(scheme.bits, scheme.group_size, scheme.symmetric, _activations_of(group, name))
        packed = require_tensor(tensors, key, torch.int32)
        shape = require_tensor(tensors, f"{name}.weight_shape").tolist()
        if len(shape) != 2:
            raise LmpressInputError(f"{FORMAT} checkpoint: {name}.weight_shape is {shape}, expected [out, in]")
        out_features, in_features = (int(v) for v in shape)
        n_groups = group_count(in_features, scheme.group_size, name)
        check_shape(key, packed, (out_features, packed_length(in_features, scheme.bits)))
        scales = require_tensor(tensors, f"{name}.weight_scale")
        check_shape(f"{name}.weight_scale", scales, (out_features, n_groups))
        if scheme.symmetric:
            zeros = torch.full((out_features, n_groups), float(2 ** (scheme.bits - 1)))
        else:
            packed_zeros = require_tensor(tensors, f"{name}.weight_zero_point", torch.int32)
            check_shape(f"{name}.weight_zero_point", packed_zeros, (packed_length(out_features, scheme.bits), n_groups))
            zeros = ct_unpack_zero_point(packed_zeros, scheme.bits, out_features).float()
        layers[name] = QuantizedWeight(
            qweight=ct_unpack_weight(packed, scheme.bits, in_features),
            scales=scales.contiguous(),
            zeros=zeros,
            scheme=scheme,
            packed=packed,
        )
    return layers


register_format(
    ExportFormat(
        name=FORMAT,
        write=export_compressed_tensors,
        refuse_scheme=ct_scheme_refusal,
        check_plan=check_ct_plan,
        read=read_compressed_tensors,
        packed_suffixes=SUFFIXES,
    )
)
