"""A checkpoint directory read straight into the runtime: no transformers model, weights memory-mapped.

``load_checkpoint(path)`` builds a ``Transformer`` from ``config.json`` and the safetensors
files of a dense checkpoint or of a GPTQ / AWQ / compressed-tensors export (lmpress's own
readers; FP8 and FP4 compressed-tensors layers too). The files are memory-mapped: one decoder
layer at a time is read, fused and repacked into the device's kernels, and its pages of the file
are then dropped from the process (``madvise(MADV_DONTNEED)``), so the peak memory is the runtime
model plus one layer, never the file beside the model. An embedding table that only serves lookups (not
tied to the output layer) stays mapped: a decode step pages in one row per token, not the
table. Nothing here imports transformers, unless the config asks for a RoPE scaling that
only transformers' formulas compute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from lmpress.checkpoint_files import MappedSafetensors, quantized_format, read_config
from lmpress.errors import LmpressInputError
from lmpress.export.kv_cache_tensors import read_kv_quant
from lmpress.memory import trim_c_heap
from lmpress.runtime.kernels import DEFAULT_CPU_ACTIVATIONS
from lmpress.runtime.linears import Build
from lmpress.runtime.model import MOE_TYPES, SUPPORTED_MODEL_TYPES, ModelArgs, Transformer
from lmpress.weights.float8 import Fp8Linear, Fp8Weight
from lmpress.weights.fp4 import Fp4Linear, Fp4Weight
from lmpress.weights.online_rotation import attach_planned_rotation, check_sylvester, rotation_plan
from lmpress.weights.qlinear import QuantizedLinear

FLOAT_STORAGE = ("F64", "F32", "F16", "BF16")  # safetensors dtypes of a dense (unquantized) weight
LINEARS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
FUSED_LINEARS = {"self_attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")}  # Phi-3
LINEARS_OF = {"phi3": FUSED_LINEARS}
# Trimming the C heap after every layer re-faults the next layer's buffers: on SmolLM2 (1.8 MB a layer) that was
# 0.15 s of a 1.5 s load. Trimmed once this many bytes of layers are read, the transients stay a few of SmolLM2's
# layers, one of a large model's.
TRIM_AFTER_BYTES = 16 << 20
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class ConfigView(SimpleNamespace):
    """``config.json`` with attribute access, as the runtime reads a transformers config."""

    def __getattr__(self, name: str) -> Any:  # only called for names config.json lacks
        raise AttributeError(name)


def read_model_config(path: Path) -> ConfigView | Any:
    """The model's config: a view of config.json, or transformers' own where RoPE scaling needs its formulas."""
    from lmpress.checkpoint_files import read_config

    def from_transformers() -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path)

    return runtime_config(read_config(path), from_transformers)


def runtime_config(raw: dict[str, Any], from_transformers: Callable[[], Any]) -> ConfigView | Any:
    """A view of the config values ``raw`` (config.json's), or ``from_transformers()`` where RoPE scaling needs
    transformers' formulas; refused where the runtime cannot read the model directly."""
    raw = dict(raw)
    if raw.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise LmpressInputError(
            f"the runtime does not support model type {raw.get('model_type')!r} (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if raw.get("model_type") in MOE_TYPES:
        raise LmpressInputError(
            f"the runtime reads {raw['model_type']} (mixture-of-experts) checkpoints through transformers, not "
            "directly: load it with lmpress.load_model and build the runtime with Transformer.from_hf"
        )
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return from_transformers()
    if "rope_parameters" not in raw:
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
    return ConfigView(**raw)


class CheckpointModel:
    """The module tree ``Transformer`` reads (``model.embed_tokens``, ``model.layers``, ...), made from the files.

    Layers are built one at a time as ``model.layers`` is iterated, and each layer's file pages are
    dropped once the next one is asked for (the runtime has copied or repacked it by then).
    """

    def __init__(self, path: Path, config: Any) -> None:
        from lmpress.checkpoint_files import safetensors_files

        self.path, self.config = path, config
        self.files = MappedSafetensors(safetensors_files(path))
        self.reader = _reader_for(path)
        quantization = (self.reader[0].get("quantization_config") or {}) if self.reader else {}
        self.rotations = rotation_plan(quantization.get("transform_config"), self._linear_names(), str(path))
        self._assemble()

    def _assemble(self) -> None:
        embed = nn.Parameter(self._tensor("model.embed_tokens.weight"), requires_grad=False)
        tied = getattr(self.config, "tie_word_embeddings", False) and not self._has("lm_head.weight")
        self.model = SimpleNamespace(
            embed_tokens=SimpleNamespace(weight=embed),
            layers=self._layers(),
            norm=_norm(self._tensor("model.norm.weight"), self.config),
        )
        self.head = _dense(embed) if tied else self._linear("lm_head")
        if not tied and not isinstance(self.head, nn.Linear):
            self._release("lm_head.")  # repacked: its pages of the file are read for good

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def _has(self, key: str) -> bool:
        return key in self.files

    def _release(self, prefix: str) -> int:
        """Drop the file pages of tensors named ``prefix...``; the bytes dropped."""
        return self.files.release(prefix)

    def _tensor(self, key: str) -> torch.Tensor:
        if key not in self.files:
            raise LmpressInputError(f"{self.path}: checkpoint lacks tensor {key!r}")
        return self.files.tensor(key)

    def _linear(self, name: str) -> nn.Module:
        bias = self.files.tensor(f"{name}.bias") if f"{name}.bias" in self.files else None
        if self._is_dense(name):
            return _dense(self.files.tensor(f"{name}.weight"), bias)
        if self.reader is None:
            raise LmpressInputError(f"{self.path}: checkpoint lacks tensor {name + '.weight'!r}")
        config, read = self.reader
        found = read(config, self.files.tensors(f"{name}."))
        if name not in found:
            raise LmpressInputError(f"{self.path}: checkpoint lacks the weights of {name!r}")
        return _quantized_linear(found[name], bias, name, self.path)

    def _linear_names(self) -> Iterator[tuple[str, str]]:
        """(name, class name) of every decoder layer's linear, as a transform_config's targets match them."""
        for i in range(self.config.num_hidden_layers):
            for block, names in LINEARS_OF.get(self.config.model_type, LINEARS).items():
                yield from ((f"model.layers.{i}.{block}.{name}", "Linear") for name in names)

    def _rotated_linear(self, name: str) -> nn.Module:
        """``_linear(name)`` with the online input rotation the checkpoint's transform_config gives it (R4)."""
        linear = self._linear(name)
        key = attach_planned_rotation(linear, name, self.rotations, str(self.path))
        if key is not None:
            check_sylvester(key, self._tensor(key), str(self.path))
        return linear

    def _is_dense(self, name: str) -> bool:
        """Whether ``name.weight`` is a float weight to run as it is. A quantized layer may store its codes
        under ``weight`` too (compressed-tensors ``int-quantized`` int8, ``float-quantized`` E4M3), always
        beside a ``weight_scale``: read as dense, those codes would run unscaled."""
        weight = f"{name}.weight"
        return (
            weight in self.files
            and self.files.where[weight][3] in FLOAT_STORAGE
            and f"{name}.weight_scale" not in self.files
        )

    def _layers(self) -> Iterator[SimpleNamespace]:
        unreturned = 0  # bytes of layers read since the C heap was last trimmed
        for i in range(self.config.num_hidden_layers):
            prefix = f"model.layers.{i}."
            layer = SimpleNamespace(
                input_layernorm=_norm(self._tensor(prefix + "input_layernorm.weight"), self.config),
                post_attention_layernorm=_norm(self._tensor(prefix + "post_attention_layernorm.weight"), self.config),
            )
            for norm in LAYER_NORMS[2:]:  # Gemma's sandwich norms
                if self._has(f"{prefix}{norm}.weight"):
                    setattr(layer, norm, _norm(self._tensor(f"{prefix}{norm}.weight"), self.config))
            for block, names in LINEARS_OF.get(self.config.model_type, LINEARS).items():
                modules = {name: self._rotated_linear(f"{prefix}{block}.{name}") for name in names}
                for norm in ("q_norm", "k_norm"):
                    if block == "self_attn" and self._has(f"{prefix}self_attn.{norm}.weight"):
                        modules[norm] = _norm(self._tensor(f"{prefix}self_attn.{norm}.weight"), self.config)
                setattr(layer, block, SimpleNamespace(**modules))
            yield layer
            unreturned += self._release(prefix)
            if unreturned >= TRIM_AFTER_BYTES:
                trim_c_heap()  # the layers' transient unpacked codes, before the next layer's (no gc: no cycles)
                unreturned = 0


class DecodedModel(CheckpointModel):
    """``CheckpointModel`` over the tensors an export's reader decoded (a GGUF file's; ``ExportFormat.read_tensors``):
    ``{module: QuantizedWeight or Fp4Weight}`` for quantized layers, ``{tensor name: tensor}`` for the rest."""

    def __init__(self, path: Path, config: Any, tensors: dict[str, Any]) -> None:
        self.path, self.config, self.tensors = path, config, tensors
        self.rotations: dict[str, tuple[str, int]] = {}  # such a format holds no online rotations
        self._assemble()

    def _has(self, key: str) -> bool:
        return key in self.tensors or key.removesuffix(".weight") in self.tensors

    def _release(self, prefix: str) -> int:
        return 0  # decoded into memory: the runtime's copies replace them as the caller drops the dict

    def _tensor(self, key: str) -> torch.Tensor:
        if key not in self.tensors:
            raise LmpressInputError(f"{self.path}: the export lacks tensor {key!r}")
        return self.tensors[key]

    def _linear(self, name: str) -> nn.Module:
        bias = self.tensors.get(f"{name}.bias")
        if f"{name}.weight" in self.tensors:
            return _dense(self.tensors[f"{name}.weight"], bias)
        if name not in self.tensors:
            raise LmpressInputError(f"{self.path}: the export lacks the weights of {name!r}")
        return _quantized_linear(self.tensors[name], bias, name, self.path)


def _quantized_linear(weight: Any, bias: torch.Tensor | None, name: str, path: Path) -> nn.Module:
    if isinstance(weight, Fp8Weight):
        return Fp8Linear.from_weight(weight, bias)
    if isinstance(weight, Fp4Weight):
        return Fp4Linear.from_weight(weight, bias)
    if not hasattr(weight, "zeros"):
        raise LmpressInputError(f"{path}: the runtime cannot run {name}'s {type(weight).__name__} layer")
    return QuantizedLinear.from_quantized_weight(weight, bias)


def _reader_for(path: Path) -> tuple[dict, Any] | None:
    """``(config.json, reader)`` for a quantized checkpoint's layers; None for a dense checkpoint."""
    config = read_config(path)
    fmt = quantized_format(path, config)
    return None if fmt is None else (config, fmt.read)


def _dense(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def _norm(weight: torch.Tensor, config: Any) -> SimpleNamespace:
    return SimpleNamespace(weight=weight, variance_epsilon=config.rms_norm_eps)


def load_checkpoint(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    kernels: str | None = None,
    cpu_activations: str = DEFAULT_CPU_ACTIVATIONS,
) -> Transformer:
    """The runtime model of the checkpoint directory at ``path`` (its manifest checked by the caller); weight-only
    layers on the CPU take ``cpu_activations`` ("int8" or "bf16")."""
    path = Path(path)
    config = read_model_config(path)
    return build_runtime(CheckpointModel(path, config), dtype, device, kernels, cpu_activations)


def load_decoded(
    path: str | Path,
    values: dict[str, Any],
    tensors: dict[str, Any],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cpu_activations: str = DEFAULT_CPU_ACTIVATIONS,
) -> Transformer:
    """The runtime model of an export at ``path`` whose reader decoded its config ``values`` and ``tensors``
    (``ExportFormat.read_tensors``)."""

    def from_transformers() -> Any:
        from transformers import AutoConfig

        others = dict(values)
        return AutoConfig.for_model(others.pop("model_type"), **others)

    config = runtime_config(values, from_transformers)
    return build_runtime(DecodedModel(Path(path), config, tensors), dtype, device, None, cpu_activations)


def build_runtime(
    source: CheckpointModel,
    dtype: torch.dtype,
    device: str | torch.device,
    kernels: str | None,
    cpu_activations: str,
) -> Transformer:
    """The ``Transformer`` of ``source``'s modules, its kernels the device's unless ``kernels`` names others."""
    config = source.config
    device = torch.device(device)
    kernels = kernels or ("cuda" if device.type == "cuda" else "cpu")
    build = Build(dtype, kernels, map_embedding=device.type == "cpu", cpu_activations=cpu_activations)
    with torch.no_grad():
        model = Transformer(ModelArgs.from_config(config), source, build).eval()
    model = model.to(device)
    quantization = getattr(config, "quantization_config", None)
    model.kv_quant = read_kv_quant(quantization, source._tensor, model.args.n_layers)  # a checkpoint's static cache
    return model
