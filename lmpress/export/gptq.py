"""GPTQ checkpoints, as GPTQModel, transformers, vLLM, SGLang and TGI read them.

Per quantized layer ``L`` (see ``weights/pack.py`` for the bit layout):

- ``L.qweight`` int32 ``(in*bits/32, out)``: codes packed along the input axis;
- ``L.qzeros`` int32 ``(n_groups, ceil(out*bits/32))``: zeros packed along the
  output axis, stored as ``zero - 1`` in checkpoint format ``gptq`` (v1);
- ``L.scales`` float16 ``(n_groups, out)``;
- ``L.g_idx`` int32 ``(in,)``: the group of each input column (act-order);
- ``L.bias`` where the layer has one.

``quantization_config`` holds the scheme most layers use; layers that differ get
a GPTQModel/vLLM ``dynamic`` entry (``"+:^name$": {bits, group_size, sym, desc_act}``)
and quantizable layers left in float a negative one (``"-:^name$": {}``).

Checkpoint format v1 cannot hold a zero of 0 (asymmetric groups whose minimum is
0); when a layer has one, the file is written as ``gptq_v2`` (zeros stored as is),
which GPTQModel and transformers read, and a warning says so.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmpress.anatomy import get_anatomy
from lmpress.checkpoint_files import check_shape, group_count, require_tensor
from lmpress.errors import LmpressInputError
from lmpress.export.formats import (
    PlannedLayer,
    act_order_g_idx,
    dense_tensors,
    escape_name,
    fp16_scales,
    plan_of,
    require_quantized_layers,
    unpack_layer,
    unquantized_linears,
    write_checkpoint,
)
from lmpress.registry import ExportFormat, register_format
from lmpress.weights.pack import (
    gptq_pack_qweight,
    gptq_pack_qzeros,
    gptq_unpack_qweight,
    gptq_unpack_qzeros,
    packed_length,
)
from lmpress.weights.qlinear import QuantizedLinear
from lmpress.weights.scheme import QuantizedWeight, QuantScheme

log = logging.getLogger(__name__)


def lmpress_version() -> str:
    try:
        return importlib.metadata.version("lmpress")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


FORMAT = "gptq"
GPTQ_BITS = (2, 3, 4, 8)
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def _layer_key(module: QuantizedLinear) -> tuple[int, int, bool, bool]:
    scheme = module.scheme
    return (scheme.bits, scheme.group_size, scheme.symmetric, act_order_g_idx(module) is not None)


def gptq_scheme_refusal(scheme: QuantScheme, act_order: bool) -> str | None:
    if scheme.bits not in GPTQ_BITS:
        return f"{scheme.bits}-bit weights; GPTQ holds {GPTQ_BITS} bits"
    return None


def check_gptq_plan(model: nn.Module, plan: dict[str, PlannedLayer]) -> None:
    for name, layer in plan.items():
        bits = layer.scheme.bits
        reason = gptq_scheme_refusal(layer.scheme, act_order=False)
        if reason:
            raise LmpressInputError(f"export gptq: {name}: {reason}")
        if layer.in_features * bits % 32:
            raise LmpressInputError(
                f"export gptq: {name} has in_features {layer.in_features}, which {bits}-bit GPTQ cannot pack "
                f"(needs a multiple of {32 // bits if 32 % bits == 0 else 32})"
            )


def gptq_tensors(name: str, qw: QuantizedWeight, v1: bool) -> dict[str, torch.Tensor]:
    """The four GPTQ tensors of one layer."""
    bits = qw.scheme.bits
    return {
        f"{name}.qweight": gptq_pack_qweight(qw.qweight, bits),
        f"{name}.qzeros": gptq_pack_qzeros(qw.zeros.round().to(torch.int64), bits, v1=v1),
        f"{name}.scales": fp16_scales(qw.scales, name, FORMAT).t().contiguous(),
        f"{name}.g_idx": qw.column_groups().to(torch.int32),
    }


def _in_decoder_layers(model: nn.Module, name: str) -> bool:
    try:
        prefix = get_anatomy(model).layers + "."
    except LmpressInputError:
        return name != "lm_head"
    return name.startswith(prefix)


def base_key(layers: dict[str, QuantizedLinear]) -> tuple[int, int, bool, bool]:
    """The most common (bits, group_size, sym, act-order) among ``layers``; ties go to the earliest layer's."""
    keys = [_layer_key(module) for module in layers.values()]
    counts = Counter(keys)
    return max(counts, key=lambda k: (counts[k], -keys.index(k)))


def gptq_quantization_config(
    model: nn.Module, layers: dict[str, QuantizedLinear], checkpoint_format: str
) -> dict[str, Any]:
    keys = {name: _layer_key(module) for name, module in layers.items()}
    base = base_key(layers)
    bits, group_size, sym, desc_act = base
    dynamic: dict[str, dict[str, Any]] = {}
    for name, key in keys.items():
        if key != base and name != "lm_head":
            dynamic[f"+:{escape_name(name)}"] = {
                "bits": key[0],
                "group_size": key[1],
                "sym": key[2],
                "desc_act": key[3],
            }
    for name in unquantized_linears(model):
        if _in_decoder_layers(model, name):
            dynamic[f"-:{escape_name(name)}"] = {}
    config: dict[str, Any] = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "true_sequential": True,
        "lm_head": "lm_head" in layers,
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"lmpress:{lmpress_version()}"]},
    }
    if dynamic:
        config["dynamic"] = dynamic
    return config


def export_gptq(model: nn.Module, tokenizer: Any, out_dir: Path) -> None:
    layers = require_quantized_layers(model, FORMAT)
    check_gptq_plan(model, plan_of(layers))
    if "lm_head" in layers and _layer_key(layers["lm_head"]) != base_key(layers):
        raise LmpressInputError(
            "export gptq: a quantized lm_head must use the same scheme as the other layers in GPTQ checkpoints"
        )
    zero_zero = [name for name, module in layers.items() if bool((module.zeros == 0).any())]
    checkpoint_format = "gptq_v2" if zero_zero else "gptq"
    if zero_zero:
        log.warning(
            "export gptq: %d layer(s) (e.g. %s) have a zero point of 0, which GPTQ v1 cannot store; "
            "writing checkpoint_format gptq_v2 (GPTQModel and transformers read it; vLLM reads v1 only)",
            len(zero_zero),
            zero_zero[0],
        )
    tensors = dense_tensors(model)
    for name, module in layers.items():
        tensors.update(gptq_tensors(name, unpack_layer(module), v1=checkpoint_format == "gptq"))
    write_checkpoint(out_dir, model, tokenizer, tensors, gptq_quantization_config(model, layers, checkpoint_format))


def _dynamic_override(qc: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The ``dynamic`` entry for ``name``: its overrides, {} for none, None when the layer is excluded."""
    for pattern, override in (qc.get("dynamic") or {}).items():
        negative = pattern.startswith("-:")
        regex = pattern[2:] if pattern[:2] in ("+:", "-:") else pattern
        if re.match(regex, name):
            return None if negative else dict(override)
    return {}


def layer_scheme(qc: dict[str, Any], name: str) -> tuple[QuantScheme, bool] | None:
    """The scheme and act-order flag of layer ``name`` under GPTQ ``quantization_config`` ``qc``."""
    override = _dynamic_override(qc, name)
    if override is None:
        return None
    settings = {k: qc.get(k) for k in ("bits", "group_size", "sym", "desc_act")} | override
    try:
        scheme = QuantScheme(int(settings["bits"]), int(settings["group_size"]), bool(settings.get("sym", True)))
    except (TypeError, ValueError, KeyError) as e:
        raise LmpressInputError(f"gptq quantization_config: bad bits/group_size for {name} ({e})") from e
    if scheme.bits not in GPTQ_BITS:
        raise LmpressInputError(f"gptq quantization_config: {scheme.bits}-bit weights are not GPTQ ({GPTQ_BITS})")
    return scheme, bool(settings.get("desc_act", False))


def read_gptq(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    qc = config["quantization_config"]
    checkpoint_format = qc.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise LmpressInputError(
            f"gptq checkpoint_format {checkpoint_format!r} is not one lmpress reads (gptq, gptq_v2)"
        )
    v1 = checkpoint_format == "gptq"
    layers = {}
    for key in sorted(k for k in tensors if k.endswith(".qweight")):
        name = key.removesuffix(".qweight")
        found = layer_scheme(qc, name)
        if found is None:
            raise LmpressInputError(f"gptq checkpoint: {name} has a qweight but quantization_config excludes it")
        scheme, _ = found
        qweight = require_tensor(tensors, key, torch.int32)
        scales = require_tensor(tensors, f"{name}.scales")
        in_features = qweight.shape[0] * 32 // scheme.bits
        out_features = scales.shape[1]
        n_groups = group_count(in_features, scheme.group_size, name)
        check_shape(f"{name}.scales", scales, (n_groups, out_features))
        check_shape(key, qweight, (packed_length(in_features, scheme.bits), out_features))
        qzeros = require_tensor(tensors, f"{name}.qzeros", torch.int32)
        check_shape(f"{name}.qzeros", qzeros, (n_groups, packed_length(out_features, scheme.bits)))
        zeros = gptq_unpack_qzeros(qzeros, scheme.bits, out_features, v1=v1)
        if int(zeros.max()) > 255:
            raise LmpressInputError(f"gptq checkpoint: {name} has zero points of 256 (v1 cannot store a zero of 0)")
        g_idx = tensors.get(f"{name}.g_idx")
        if g_idx is not None:
            check_shape(f"{name}.g_idx", g_idx, (in_features,))
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= n_groups:
                raise LmpressInputError(f"gptq checkpoint: {name}.g_idx names groups outside [0, {n_groups})")
            g_idx = g_idx.to(torch.int32)
            if torch.equal(g_idx.long(), torch.arange(in_features) // scheme.group_width(in_features)):
                g_idx = None
        layers[name] = QuantizedWeight(
            qweight=gptq_unpack_qweight(qweight, scheme.bits, in_features),
            scales=scales.t().contiguous(),
            zeros=zeros.float(),
            scheme=scheme,
            g_idx=g_idx,
        )
    return layers


register_format(
    ExportFormat(
        name=FORMAT,
        write=export_gptq,
        refuse_scheme=gptq_scheme_refusal,
        check_plan=check_gptq_plan,
        read=read_gptq,
        packed_suffixes=SUFFIXES,
    )
)
