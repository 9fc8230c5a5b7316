"""AWQ GEMM checkpoints (AutoAWQ's ``version: gemm``), as transformers, vLLM and TGI read them.

Per quantized layer ``L`` (4-bit only; see ``weights/pack.py`` for the interleave):

- ``L.qweight`` int32 ``(in, out/8)``: codes packed along the output axis;
- ``L.qzeros`` int32 ``(in/group_size, out/8)``: zeros, packed the same way;
- ``L.scales`` float16 ``(in/group_size, out)``;
- ``L.bias`` where the layer has one.

The format has one group size for the whole model, no act-order, and always
stores zeros (``zero_point: true``): a symmetric layer is written with zeros of 8,
which dequantizes to the same values. Layers that stay in float are listed in
``modules_to_not_convert``.
"""

from __future__ import annotations

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
    fp16_scales,
    plan_of,
    require_quantized_layers,
    unpack_layer,
    unquantized_linears,
    write_checkpoint,
)
from lmpress.registry import ExportFormat, register_format
from lmpress.weights.pack import awq_pack, awq_unpack
from lmpress.weights.scheme import QuantizedWeight, QuantScheme

FORMAT = "awq"
AWQ_BITS = 4
SUFFIXES = ("qweight", "qzeros", "scales")


def awq_scheme_refusal(scheme: QuantScheme, act_order: bool) -> str | None:
    if scheme.bits != AWQ_BITS:
        return f"{scheme.bits}-bit weights; AWQ GEMM holds 4-bit weights only (export gptq or compressed-tensors)"
    if scheme.group_size == -1:
        return "per-channel scales (group_size -1); AWQ GEMM needs a group size (32, 64, 128)"
    if act_order:
        return "act-order (g_idx), which AWQ GEMM cannot hold; set static_groups: true, or export gptq"
    return None


def check_awq_plan(model: nn.Module, plan: dict[str, PlannedLayer]) -> int:
    """Refuse what AWQ GEMM cannot hold; returns the model's one group size."""
    try:
        layer_prefix = get_anatomy(model).layers + "."
    except LmpressInputError:
        layer_prefix = ""
    group_sizes: dict[int, str] = {}
    for name, layer in plan.items():
        scheme = layer.scheme
        reason = awq_scheme_refusal(scheme, act_order=False)
        if reason:
            raise LmpressInputError(f"export awq: {name}: {reason}")
        if layer.out_features % 8:
            raise LmpressInputError(f"export awq: {name} has {layer.out_features} outputs; AWQ packs multiples of 8")
        if layer_prefix and not name.startswith(layer_prefix):
            raise LmpressInputError(
                f"export awq: {name} is quantized, but AWQ quantizes decoder layers only; add it to the stage's ignore"
            )
        group_sizes.setdefault(scheme.group_size, name)
    if len(group_sizes) > 1:
        described = ", ".join(f"{g} ({n})" for g, n in group_sizes.items())
        raise LmpressInputError(f"export awq: AWQ holds one group size per model, this one has {described}")
    return next(iter(group_sizes))


def awq_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The three AWQ GEMM tensors of one layer."""
    return {
        f"{name}.qweight": awq_pack(qw.qweight.t()),
        f"{name}.qzeros": awq_pack(qw.zeros.round().to(torch.int64).t()),
        f"{name}.scales": fp16_scales(qw.scales, name, FORMAT).t().contiguous(),
    }


def export_awq(model: nn.Module, tokenizer: Any, out_dir: Path) -> None:
    layers = require_quantized_layers(model, FORMAT)
    group_size = check_awq_plan(model, plan_of(layers))
    for name, module in layers.items():
        if act_order_g_idx(module) is not None:
            raise LmpressInputError(
                f"export awq: {name} uses act-order (g_idx), which AWQ cannot hold; export gptq instead"
            )
    tensors = dense_tensors(model)
    for name, module in layers.items():
        tensors.update(awq_tensors(name, unpack_layer(module)))
    quantization_config = {
        "quant_method": "awq",
        "version": "gemm",
        "bits": AWQ_BITS,
        "group_size": group_size,
        "zero_point": True,
        "modules_to_not_convert": [n for n in unquantized_linears(model) if n != "lm_head"] or None,
    }
    write_checkpoint(out_dir, model, tokenizer, tensors, quantization_config)


def read_awq(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    qc = config["quantization_config"]
    version = str(qc.get("version", "gemm")).lower()
    bits = int(qc.get("bits", qc.get("w_bit", AWQ_BITS)))
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if version != "gemm" or bits != AWQ_BITS or not qc.get("zero_point", True):
        raise LmpressInputError(
            f"awq checkpoint: version {version!r}, {bits} bits, zero_point {qc.get('zero_point', True)}; "
            "lmpress reads 4-bit gemm with zero points"
        )
    layers = {}
    for key in sorted(k for k in tensors if k.endswith(".qweight")):
        name = key.removesuffix(".qweight")
        qweight = require_tensor(tensors, key, torch.int32)
        scales = require_tensor(tensors, f"{name}.scales")
        in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
        n_groups = group_count(in_features, group_size, name)
        check_shape(f"{name}.scales", scales, (n_groups, out_features))
        qzeros = require_tensor(tensors, f"{name}.qzeros", torch.int32)
        check_shape(f"{name}.qzeros", qzeros, (n_groups, out_features // 8))
        zeros = awq_unpack(qzeros).t().float()
        symmetric = bool((zeros == 2 ** (AWQ_BITS - 1)).all())
        layers[name] = QuantizedWeight(
            qweight=awq_unpack(qweight).t().contiguous(),
            scales=scales.t().contiguous(),
            zeros=zeros.contiguous(),
            scheme=QuantScheme(AWQ_BITS, group_size, symmetric),
        )
    return layers


register_format(
    ExportFormat(
        name=FORMAT,
        write=export_awq,
        refuse_scheme=awq_scheme_refusal,
        check_plan=check_awq_plan,
        read=read_awq,
        packed_suffixes=SUFFIXES,
    )
)
