"""FP4 layers in compressed-tensors checkpoints: ``nvfp4-pack-quantized`` and ``mxfp4-pack-quantized``.

An ``Fp4Linear`` already holds its weight in compressed-tensors' names and encodings, so its buffers are the
tensors written (``L.weight_packed`` uint8 ``(out, in/2)``, two E2M1 codes a byte, the lower column in the
low nibble; ``L.weight_scale`` float8_e4m3fn (NVFP4) or E8M0 bytes (MXFP4) ``(out, in/block)``;
``L.weight_global_scale`` float32 ``(1,)`` for NVFP4; ``L.input_global_scale`` float32 ``(1,)`` for NVFP4
W4A4). There is no ``weight_shape``: the input width is twice the packed one.

The config group's ``weights`` and ``input_activations`` are those of compressed-tensors' presets
(``preset_name_to_scheme("NVFP4A16" | "NVFP4" | "MXFP4A16" | "MXFP4")``), serialized as llm-compressor's
``ModelCompressor.update_config`` writes them: NVFP4 ``strategy: tensor_group`` with ``group_size: 16`` and
``scale_dtype: torch.float8_e4m3fn``, W4A4 activations ``dynamic: local`` (per-block scales per call under the
static ``input_global_scale``); MXFP4 ``strategy: group`` with ``group_size: 32`` and ``scale_dtype:
torch.uint8``, W4A4 activations ``dynamic: true``.

Reading checks what a damaged or foreign file could hold before any value is used: dtypes, shapes, E4M3 scales
finite and non-negative, E8M0 bytes other than 255 (NaN), global scales finite and positive.
"""

from __future__ import annotations

from typing import Any

import torch

from lmpress.checkpoint_files import check_shape, require_tensor
from lmpress.errors import LmpressInputError
from lmpress.weights.float8 import require_float8
from lmpress.weights.fp4 import E8M0_NAN, FP4_BLOCK, Fp4Linear, Fp4Weight, decode_e8m0, fp4_format_of, unpack_fp4
from lmpress.weights.scheme import QuantScheme

FORMAT = "compressed-tensors"
NVFP4_PACK_QUANTIZED = "nvfp4-pack-quantized"
MXFP4_PACK_QUANTIZED = "mxfp4-pack-quantized"
FP4_CT_FORMATS = {"nvfp4": NVFP4_PACK_QUANTIZED, "mxfp4": MXFP4_PACK_QUANTIZED}
# an FP4 layer's own tensors, besides its bias
FP4_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
SCALE_DTYPE_NAMES = {"nvfp4": "torch.float8_e4m3fn", "mxfp4": "torch.uint8"}


def fp4_weight_args(fmt: str) -> dict[str, Any]:
    """compressed-tensors' ``QuantizationArgs`` of NVFP4 / MXFP4 weights, as its presets serialize them."""
    return {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": FP4_BLOCK[fmt],
        "strategy": "tensor_group" if fmt == "nvfp4" else "group",
        "dynamic": False,
        "scale_dtype": SCALE_DTYPE_NAMES[fmt],
    }


def fp4_activation_args(fmt: str) -> dict[str, Any]:
    """The W4A4 presets' ``input_activations``: per-block FP4 scales computed per call ("local" under NVFP4's
    static ``input_global_scale``; wholly dynamic for MXFP4)."""
    args = fp4_weight_args(fmt) | {"dynamic": "local" if fmt == "nvfp4" else True}
    if fmt == "nvfp4":
        args["observer"] = "static_minmax"
    return args


def fp4_group_args(scheme: QuantScheme) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """(weights, input_activations, format) of the config group of FP4 scheme ``scheme``."""
    fmt = fp4_format_of(scheme)
    activations = fp4_activation_args(fmt) if scheme.activations == "fp4" else None
    return fp4_weight_args(fmt), activations, FP4_CT_FORMATS[fmt]


def fp4_tensors(name: str, module: Fp4Linear) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one FP4 layer (its buffers, which carry those names; bias aside)."""
    tensors = {}
    for suffix in FP4_SUFFIXES:
        tensor = getattr(module, suffix, None)
        if tensor is not None:
            tensors[f"{name}.{suffix}"] = tensor.detach().cpu().clone()
    return tensors


def is_fp4_args(args: dict[str, Any] | None) -> bool:
    """Whether a config group's ``weights`` describe 4-bit floats."""
    return bool(args) and args.get("type") == "float" and args.get("num_bits") == 4


def _fp4_format_of_args(name: str, args: dict[str, Any]) -> str:
    for fmt in ("nvfp4", "mxfp4"):
        expected = fp4_weight_args(fmt)
        layout = (args.get("group_size"), args.get("strategy"))
        if layout == (expected["group_size"], expected["strategy"]) and args.get("symmetric", True):
            scale_dtype = str(args.get("scale_dtype") or expected["scale_dtype"])
            if scale_dtype.removeprefix("torch.") != expected["scale_dtype"].removeprefix("torch."):
                raise LmpressInputError(
                    f"{FORMAT} checkpoint: {name} is {fmt.upper()} with scale_dtype {scale_dtype}; lmpress reads "
                    f"{expected['scale_dtype']} scales there"
                )
            return fmt
    raise LmpressInputError(
        f"{FORMAT} checkpoint: {name} has 4-bit float weights with strategy {args.get('strategy')!r}, group_size "
        f"{args.get('group_size')!r}, symmetric {args.get('symmetric', True)}; lmpress reads NVFP4 (tensor_group, 16) "
        "and MXFP4 (group, 32), symmetric"
    )


def _fp4_activations(name: str, group: dict[str, Any], fmt: str) -> str | None:
    args = group.get("input_activations")
    if not args:
        return None
    expected = fp4_activation_args(fmt)
    keys = ("type", "num_bits", "strategy", "group_size", "dynamic")
    read = tuple(str(args.get(k)).lower() for k in keys)
    if read != tuple(str(expected[k]).lower() for k in keys):
        raise LmpressInputError(
            f"{FORMAT} checkpoint: {name} has {fmt.upper()} weights with input activations "
            f"{dict(zip(keys, read, strict=True))}; lmpress runs {fmt.upper()} activations as compressed-tensors' "
            f"{fmt.upper()} preset defines them ({dict((k, expected[k]) for k in keys)}) or float activations"
        )
    return "fp4"


def _positive_scalar(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    value = require_tensor(tensors, key)
    if value.numel() != 1 or not value.is_floating_point():
        raise LmpressInputError(f"{FORMAT} checkpoint: {key} is {value.dtype} {tuple(value.shape)}, expected one float")
    value = value.float().reshape(1)
    if not bool(torch.isfinite(value).all()) or float(value) <= 0:
        raise LmpressInputError(f"{FORMAT} checkpoint: {key} is {float(value)}, expected a finite positive scale")
    return value


def read_fp4(name: str, tensors: dict[str, torch.Tensor], group: dict[str, Any]) -> Fp4Weight:
    """One FP4 layer of a compressed-tensors checkpoint as an ``Fp4Weight``, after checking every tensor."""
    fmt = _fp4_format_of_args(name, group.get("weights") or {})
    scheme = QuantScheme(4, FP4_BLOCK[fmt], True, _fp4_activations(name, group, fmt), fp4=fmt)
    packed = require_tensor(tensors, f"{name}.weight_packed", torch.uint8)
    if packed.dim() != 2:
        raise LmpressInputError(f"{FORMAT} checkpoint: {name}.weight_packed has shape {tuple(packed.shape)}, not 2-D")
    out_features, in_features = packed.shape[0], 2 * packed.shape[1]
    block = FP4_BLOCK[fmt]
    if in_features % block:
        raise LmpressInputError(
            f"{FORMAT} checkpoint: {name}.weight_packed holds {in_features} columns, not whole {fmt.upper()} "
            f"blocks of {block}"
        )
    key = f"{name}.weight_scale"
    stored = require_tensor(tensors, key, require_float8(key) if fmt == "nvfp4" else torch.uint8)
    check_shape(key, stored, (out_features, in_features // block))
    global_scale = input_global_scale = None
    if fmt == "nvfp4":
        scales = stored.float()
        bad = ~torch.isfinite(scales) | (scales < 0)
        if bool(bad.any()):
            row, column = (int(i) for i in bad.nonzero()[0])
            raise LmpressInputError(
                f"{FORMAT} checkpoint: {key}[{row}, {column}] is {float(scales[row, column])}; E4M3 block scales "
                "are finite and non-negative"
            )
        global_scale = _positive_scalar(tensors, f"{name}.weight_global_scale")
        if scheme.activations == "fp4":
            input_global_scale = _positive_scalar(tensors, f"{name}.input_global_scale")
    else:
        nan = stored == E8M0_NAN
        if bool(nan.any()):
            row, column = (int(i) for i in nan.nonzero()[0])
            raise LmpressInputError(
                f"{FORMAT} checkpoint: {key}[{row}, {column}] is E8M0 byte 255 (NaN); MXFP4 block scales are 0..254"
            )
        scales = decode_e8m0(stored)
    weight = Fp4Weight(unpack_fp4(packed), scales.contiguous(), scheme, global_scale, input_global_scale)
    if not bool(torch.isfinite(weight.effective_scales()).all()):
        raise LmpressInputError(
            f"{FORMAT} checkpoint: {name}'s block scales over its weight_global_scale overflow float32"
        )
    return weight
