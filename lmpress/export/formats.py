"""What the quantized-checkpoint writers (gptq, awq, compressed_tensors) and their readers share.

A quantized checkpoint here is a Hugging Face model directory: ``config.json``
with a ``quantization_config``, the tokenizer files, and ``model.safetensors``
holding every tensor under its Hugging Face name; quantized linear layers are
stored as the format's packed tensors instead of ``<layer>.weight``.

Readers turn a checkpoint back into lmpress's one internal form, a
``QuantizedWeight`` per quantized layer (``load_quantized_checkpoint``), or into a
model whose quantized layers are ``QuantizedLinear`` modules (``load_quantized_model``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmpress.checkpoint_files import CONFIG_NAME, SAFETENSORS_NAME, quantized_format, read_config, read_tensors
from lmpress.errors import LmpressInputError
from lmpress.export.kv_cache_tensors import SCALE_SUFFIXES, read_kv_quant
from lmpress.quantize.kv_attention import attach_kv_quant
from lmpress.registry import ExportFormat, artifact_format, export_format
from lmpress.weights.apply import apply_quantized_weight
from lmpress.weights.online_rotation import ROTATION_FORMATS, attach_transform_config, check_sylvester
from lmpress.weights.qlinear import QuantizedLinear, trivial_g_idx
from lmpress.weights.scheme import QuantizedWeight, QuantScheme

# a quantized layer's own buffers: QuantizedLinear's packed form; Fp8Linear's E4M3 weight and its scale;
# Fp4Linear's packed E2M1 codes, block scales and global scales
QUANTIZED_BUFFERS = (
    "qweight",
    "scales",
    "zeros",
    "g_idx",
    "weight",
    "weight_scale",
    "weight_packed",
    "weight_global_scale",
    "input_global_scale",
)

# Planning: what a format can hold, checked before any quantization runs ----------------------


@dataclass(frozen=True)
class PlannedLayer:
    """One linear layer as a format sees it before (or after) quantization."""

    scheme: QuantScheme
    in_features: int
    out_features: int


# formats that describe quantized activations (W8A8); every other format would drop them silently
ACTIVATION_FORMATS = ("compressed-tensors",)


def activation_refusal(fmt: str, scheme: QuantScheme) -> str | None:
    if scheme.activations is None or fmt in ACTIVATION_FORMATS:
        return None
    kind = "W4A4" if scheme.activations == "fp4" else f"W{scheme.bits}A8"
    return (
        f"{scheme.activations} activations ({kind}), which {fmt} cannot describe (it would run the weights "
        f"with float activations); export {' or '.join(ACTIVATION_FORMATS)}"
    )


# formats that hold 4-bit float (NVFP4, MXFP4) weights; each one's refuse_scheme says which grids
FP4_FORMATS = ("compressed-tensors", "hf", "gguf")


def fp4_refusal(fmt: str, scheme: QuantScheme) -> str | None:
    """Why ``fmt`` cannot hold FP4 weights at all (None for integer schemes and for the FP4 formats)."""
    if scheme.fp4 is None or fmt in FP4_FORMATS:
        return None
    return (
        f"{scheme.fp4.upper()} weights (E2M1 in blocks of {scheme.group_size}), which {fmt} cannot hold (it stores "
        "integer codes); export compressed-tensors (nvfp4/mxfp4-pack-quantized), hf (dequantized), or gguf for MXFP4"
    )


def scheme_refusal(fmt: str, scheme: QuantScheme, act_order: bool) -> str | None:
    """Why ``fmt`` cannot hold a layer quantized with ``scheme`` (act-order ``g_idx`` when ``act_order``)."""
    refusal = activation_refusal(fmt, scheme) or fp4_refusal(fmt, scheme)
    if refusal:
        return refusal
    check = export_format(fmt).refuse_scheme
    return None if check is None else check(scheme, act_order)


def check_recipe_exports(stages: list[Any], formats: list[str]) -> None:
    """Refuse, from the recipe alone (before any model is loaded), formats that cannot hold a stage's schemes.

    A stage writes act-order ``g_idx`` when it permutes columns (``act_order``)
    without ``static_groups`` and has more than one group per row.
    """
    _check_bitsandbytes_exports(stages, formats)
    for i, stage in enumerate(stages):
        if getattr(stage, "rotate_down_proj", False):
            for j, fmt in enumerate(formats):
                if fmt not in ROTATION_FORMATS:
                    raise LmpressInputError(
                        f"export.formats[{j}] {fmt}: stages[{i}] rotate: rotate_down_proj turns down_proj's input "
                        f"at run time, which {fmt} cannot express; export {' or '.join(ROTATION_FORMATS)}"
                    )
    for i, stage in enumerate(stages):
        if not hasattr(stage, "planned_schemes"):
            continue
        reorders = bool(getattr(stage, "act_order", False)) and not getattr(stage, "static_groups", False)
        for where, scheme in stage.planned_schemes():
            act_order = reorders and scheme.group_size != -1
            for j, fmt in enumerate(formats):
                reason = scheme_refusal(fmt, scheme, act_order)
                if reason:
                    raise LmpressInputError(f"export.formats[{j}] {fmt}: stages[{i}]{where}: {reason}")


BNB_FORMAT = "bitsandbytes"
BNB_STAGES = ("llm_int8", "bnb_4bit")
BNB_HOLDERS = (BNB_FORMAT, "hf")  # hf: transformers saves bitsandbytes layers with their quantization_config


def _check_bitsandbytes_exports(stages: list[Any], formats: list[str]) -> None:
    """bitsandbytes layers hold int8 or packed 4-bit codes under ``weight``: only bitsandbytes' own
    serialization keeps them (another writer would store the codes as float weights); and that format
    needs such layers to write."""
    bnb = [i for i, stage in enumerate(stages) if getattr(stage, "method", None) in BNB_STAGES]
    for j, fmt in enumerate(formats):
        if fmt == BNB_FORMAT and not bnb:
            raise LmpressInputError(
                f"export.formats[{j}] {fmt}: no stage makes bitsandbytes layers; add a llm_int8 or bnb_4bit stage"
            )
        if bnb and fmt not in BNB_HOLDERS:
            raise LmpressInputError(
                f"export.formats[{j}] {fmt}: stages[{bnb[0]}] {stages[bnb[0]].method} makes bitsandbytes layers, "
                f"which only {' and '.join(BNB_HOLDERS)} write; export {BNB_FORMAT}"
            )


def artifact_loader(path: Path) -> Callable[[Path, torch.dtype], nn.Module] | None:
    """The loader of the single-file export in directory ``path`` (no config.json: model.gguf, model.onnx), or None."""
    path = Path(path)
    if not path.is_dir() or (path / CONFIG_NAME).exists():
        return None
    fmt = artifact_format(path)
    return None if fmt is None else fmt.load_artifact


def check_export_plan(fmt: str, model: nn.Module, targets: dict[str, tuple[nn.Module, QuantScheme]]) -> None:
    """Refuse, before any work, a format that cannot hold the layers the stages will quantize.

    ``targets`` is what the recipe's stages' ``quantized_linears(model)`` return, merged. Act-order is only
    known after quantization and is checked when writing.
    """
    check = export_format(fmt).check_plan or (lambda model, plan: None)
    plan = {name: PlannedLayer(scheme, m.in_features, m.out_features) for name, (m, scheme) in targets.items()}
    for name, layer in plan.items():
        reason = scheme_refusal(fmt, layer.scheme, act_order=False)
        if reason:
            raise LmpressInputError(f"export {fmt}: {name}: {reason}")
    if plan:
        check(model, plan)


def plan_of(layers: dict[str, QuantizedLinear]) -> dict[str, PlannedLayer]:
    return {name: PlannedLayer(m.scheme, m.in_features, m.out_features) for name, m in layers.items()}


# Writing ------------------------------------------------------------------------------------


def quantized_layers(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def refuse_fp4_layers(model: nn.Module, fmt: str) -> None:
    """Refuse writing ``model`` as ``fmt`` when it holds FP4 layers the format cannot hold (a writer that looks at
    integer layers only would write their buffers as dense tensors, or drop them)."""
    from lmpress.weights.fp4 import fp4_layers

    for name, module in fp4_layers(model).items():
        refusal = scheme_refusal(fmt, module.scheme, act_order=False)
        if refusal:
            raise LmpressInputError(f"export {fmt}: {name}: {refusal}")


def require_quantized_layers(model: nn.Module, fmt: str) -> dict[str, QuantizedLinear]:
    refuse_fp4_layers(model, fmt)
    layers = quantized_layers(model)
    if not layers:
        raise LmpressInputError(
            f"export {fmt}: the model has no quantized layers; add a quantization stage (rtn, gptq, awq) "
            "before this export, or export format 'hf' for a dense checkpoint"
        )
    for name, module in layers.items():
        refusal = activation_refusal(fmt, module.scheme)
        if refusal:
            raise LmpressInputError(f"export {fmt}: {name}: {refusal}")
    return layers


def unquantized_linears(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def act_order_g_idx(module: QuantizedLinear) -> torch.Tensor | None:
    """The layer's ``g_idx``, or None when it only repeats what the group size says (no act-order)."""
    g_idx = module.g_idx
    if g_idx is None or trivial_g_idx(g_idx, module.in_features, module.scheme):
        return None
    return g_idx


def unpack_layer(module: QuantizedLinear) -> QuantizedWeight:
    """One layer's codes, unpacked: writers unpack one layer at a time, never the whole model's codes."""
    qw = module.unpack()
    if act_order_g_idx(module) is None:
        qw.g_idx = None
    return qw


def dense_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every persistent tensor of ``model`` outside the quantized layers' packed buffers.

    Tensors sharing storage (tied embeddings) are written once, under the first name.
    """
    packed = {f"{name}.{b}" for name in quantized_layers(model) for b in QUANTIZED_BUFFERS}
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for key, tensor in model.state_dict().items():
        if key in packed:
            continue
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if identity in seen:
            continue
        seen.add(identity)
        tensors[key] = tensor.detach().cpu().contiguous()
    return tensors


def fp16_scales(scales: torch.Tensor, layer: str, fmt: str) -> torch.Tensor:
    """Scales as float16 (what GPTQ and AWQ checkpoints hold); refuses values float16 cannot hold."""
    half = scales.to(torch.float16)
    if not bool(torch.isfinite(half).all()) or bool(((half == 0) & (scales != 0)).any()):
        raise LmpressInputError(
            f"export {fmt}: {layer} has scales outside float16's range "
            f"[{scales.abs().min().item():.3g}, {scales.abs().max().item():.3g}]; "
            "export compressed-tensors (float32 scales) instead"
        )
    return half


def model_config_dict(model: nn.Module, quantization_config: dict[str, Any], untie: bool) -> dict[str, Any]:
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["quantization_config"] = quantization_config
    if untie:
        config["tie_word_embeddings"] = False
    return config


def write_checkpoint(
    out_dir: Path,
    model: nn.Module,
    tokenizer: Any,
    tensors: dict[str, torch.Tensor],
    quantization_config: dict[str, Any],
) -> None:
    """Write ``tensors``, config.json (with ``quantization_config``), the generation config and tokenizer."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(tensors.items())), out_dir / SAFETENSORS_NAME, metadata={"format": "pt"})
    # A quantized lm_head no longer shares the embedding's storage: consumers must not re-tie it.
    untie = "lm_head.weight" not in tensors and any(k.startswith("lm_head.") for k in tensors)
    config = model_config_dict(model, quantization_config, untie)
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def escape_name(name: str) -> str:
    """A regular expression that matches exactly the module ``name``."""
    return "^" + re.escape(name) + "$"


def _load_parts(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], ExportFormat]:
    config = read_config(path)
    fmt = quantized_format(path, config)
    if fmt is None:
        raise LmpressInputError(f"{path}: config.json has no quantization_config (a dense checkpoint?)")
    return config, read_tensors(path), fmt


def load_quantized_checkpoint(path: str | Path) -> dict[str, QuantizedWeight]:
    """Every quantized layer of the checkpoint at ``path``, by module name."""
    config, tensors, fmt = _load_parts(Path(path))
    return fmt.read(config, tensors)


def load_quantized_model(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The checkpoint at ``path`` as a transformers model whose quantized layers are QuantizedLinear.

    The model is built from its config without initializing weights (every tensor
    comes from the checkpoint), its linears swapped for the stored quantized ones,
    and the remaining tensors loaded; float tensors take ``dtype``, quantized
    layers keep their stored scales. Needs nothing beyond lmpress's own
    dependencies (no GPTQ/AWQ kernels package).
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    path = Path(path)
    config_dict, tensors, fmt = _load_parts(path)
    layers = fmt.read(config_dict, tensors)
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    applied: set[str] = set()

    def apply(names: list[str]) -> None:
        for name in names:
            try:
                apply_quantized_weight(model, name, layers[name])
            except (AttributeError, TypeError, ValueError) as e:
                raise LmpressInputError(f"{path}: quantized layer {name!r} does not fit the model ({e})") from e
            applied.add(name)

    if any(".experts." in name for name in layers):  # MoE: the experts were quantized one linear each
        from lmpress.calib.moe import unfuse_each

        for block in unfuse_each(model):  # each block's float copies packed before the next block's are made
            apply([name for name in layers if name.startswith(f"{block}.")])
    apply([name for name in layers if name not in applied])
    packed = {f"{name}.{suffix}" for name in layers for suffix in fmt.packed_suffixes}
    dense = {k: v for k, v in tensors.items() if k not in packed}
    qc = config_dict.get("quantization_config") or {}
    for key in attach_transform_config(model, qc.get("transform_config"), str(path)):
        check_sylvester(key, _tensor_of(tensors, path)(key), str(path))  # what the rotation runs is a butterfly
        del dense[key]
    kv = read_kv_quant(config_dict.get("quantization_config"), _tensor_of(tensors, path), config.num_hidden_layers)
    if kv is not None:  # the attention modules' k_scale / v_scale: the cache's, not the model's parameters
        dense = {k: v for k, v in dense.items() if not k.endswith(SCALE_SUFFIXES)}
        attach_kv_quant(model, kv)
    held = {f"{name}.{buffer}" for name in layers for buffer in QUANTIZED_BUFFERS}
    expected = {k: v for k, v in model.state_dict().items() if k not in held}
    unexpected = sorted(set(dense) - set(expected))
    if unexpected:
        raise LmpressInputError(f"{path}: tensor {unexpected[0]!r} belongs to no module of the model")
    tied = _tied_keys(model) & (set(expected) - set(dense))
    missing = sorted(set(expected) - set(dense) - tied)
    if missing:
        raise LmpressInputError(f"{path}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[0]!r}")
    for key, value in dense.items():
        if tuple(expected[key].shape) != tuple(value.shape):
            raise LmpressInputError(
                f"{path}: {key!r} has shape {tuple(value.shape)}, the model expects {tuple(expected[key].shape)}"
            )
    # The dense tensors become the parameters themselves (assign), in the requested dtype: a copy into the
    # skeleton's would leave the file's pages resident beside it (the mapping lives as long as the packed codes
    # viewing it), so each float tensor would be held twice (an untied float32 head and table: 226 MB)
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in dense.items()}, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):  # assigned parameters replace the tied ones: tie them again
        model.tie_weights()
    return model.eval()


def _tensor_of(tensors: dict[str, torch.Tensor], path: Path) -> Callable[[str], torch.Tensor]:
    def tensor(key: str) -> torch.Tensor:
        if key not in tensors:
            raise LmpressInputError(f"{path}: checkpoint lacks tensor {key!r}")
        return tensors[key]

    return tensor


def _tied_keys(model: nn.Module) -> set[str]:
    """State-dict keys whose tensor shares storage with an earlier key (written once, under the first name)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    tied = set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if identity in seen:
            tied.add(key)
        seen.add(identity)
    return tied
