"""Mixture-of-experts checkpoints stored one tensor per expert, loaded as per-expert linears mapped from the files.

transformers 5 stacks a MoE checkpoint's per-expert tensors (``mlp.experts.{e}.gate_proj.weight``...) into fused
``(E, 2I, H)`` / ``(E, H, I)`` parameters while it loads them: new memory holding every expert of every layer at
once (1.3 TB for DeepSeek-V3 in bfloat16), where a dense checkpoint's weights stay mapped from its files and the
layer-wise engine reads one layer at a time. Here such a checkpoint is built on the meta device, its experts split
into :class:`UnfusedExperts` (whose module names are the checkpoint's own, or Mixtral's after a rename), and every
tensor stored in the run's dtype is a zero-copy view of the memory-mapped files: a layer's experts are read from
disk when the engine reaches that layer and their pages given back once they are quantized (``calib.pages``), as a
dense model's are. A checkpoint whose tensors cannot all be named so (gpt-oss stores its experts fused; a family
renamed in ways not listed here) is left to transformers' loader.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from lmpress.calib.moe import UnfusedExperts, unfuse_experts
from lmpress.checkpoint_files import MappedSafetensors, read_tensor_headers, safetensors_files

PER_EXPERT_KEY = re.compile(r"\.experts\.\d+\.")
FUSED_ON_DISK = frozenset({"gpt_oss"})  # families whose checkpoints store the experts stacked
# model state name -> its name in the family's checkpoints, where transformers renames while loading
RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": (
        (".mlp.", ".block_sparse_moe."),
        (".gate_proj.", ".w1."),
        (".down_proj.", ".w2."),
        (".up_proj.", ".w3."),
    ),
}


def stored_name(model_type: str) -> Callable[[str], str]:
    """The checkpoint's name for a model state name of family ``model_type``."""
    renames = RENAMES.get(model_type, ())

    def rename(name: str) -> str:
        for old, new in renames:
            name = name.replace(old, new)
        return name

    return rename


def loaded_state(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """Every parameter and persistent buffer a checkpoint holds: (full name, owning module, attribute, tensor)."""
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for attribute, tensor in module._parameters.items():
            if tensor is not None:
                yield dot + attribute, module, attribute, tensor
        for attribute, tensor in module._buffers.items():
            if tensor is not None and attribute not in module._non_persistent_buffers_set:
                yield dot + attribute, module, attribute, tensor


def checkpoint_names(model: nn.Module, model_type: str, stored: Iterable[str]) -> dict[str, str] | None:
    """Each state name of ``model`` (its experts unfused) -> the tensor of ``stored`` holding it, when every
    expert is stored on its own and every other tensor under its name (tied weights may be absent: they are tied
    after loading); None otherwise."""
    stored = set(stored)
    if model_type in FUSED_ON_DISK or not any(PER_EXPERT_KEY.search(key) for key in stored):
        return None
    rename = stored_name(model_type)
    names = {}
    tied = tied_names(model)
    for name, *_ in loaded_state(model):
        key = rename(name)
        if key in stored:
            names[name] = key
        elif name not in tied:
            return None
    return names


def tied_names(model: nn.Module) -> set[str]:
    """The parameters tied to another one (the output head to the embedding), loaded by tying them."""
    tie = getattr(model.config, "tie_word_embeddings", False) or getattr(
        model.config.get_text_config(), "tie_word_embeddings", False
    )
    head = model.get_output_embeddings() if tie else None
    if head is None:
        return set()
    return {f"{name}.weight" for name, module in model.named_modules() if module is head}


def experts_stream(checkpoint: Path, skeleton: nn.Module) -> bool:
    """Whether the experts of ``skeleton`` (a model on the meta device, MoE experts unfused) load mapped from
    ``checkpoint``'s files (:func:`load_mapped_experts`); a directory with only a config stands for the checkpoint
    its family ships, stored per expert unless the family stacks them (``FUSED_ON_DISK``)."""
    if not any(isinstance(m, UnfusedExperts) for m in skeleton.modules()):
        return True
    model_type = skeleton.config.model_type
    if not any(checkpoint.glob("*.safetensors")):
        return model_type not in FUSED_ON_DISK
    return checkpoint_names(skeleton, model_type, read_tensor_headers(checkpoint)) is not None


def load_mapped_experts(path: Path, dtype: torch.dtype, trust_remote_code: bool = False) -> nn.Module | None:
    """The MoE checkpoint at ``path`` with its experts as per-expert linears and every tensor mapped from its
    files (copied only where stored in another dtype than ``dtype``), or None when the checkpoint is not a MoE one
    stored per expert (or is quantized): transformers' loader takes it then."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    files = safetensors_files(path)
    mapped = MappedSafetensors(files)
    if not any(PER_EXPERT_KEY.search(key) for key in mapped.keys()):
        return None
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        return None
    with init_empty_weights(include_buffers=False):  # the rotary tables are computed, not stored
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        unfuse_experts(model)
    names = checkpoint_names(model, config.model_type, mapped.keys())
    if names is None:
        return None
    for name, module, attribute, tensor in list(loaded_state(model)):
        if name not in names:
            continue
        value = mapped.tensor(names[name])
        if value.is_floating_point():
            value = value.to(tensor.dtype)  # the dtype the model gives it (a router's float32 bias stays so)
        if attribute in module._parameters:
            module._parameters[attribute] = nn.Parameter(value, requires_grad=tensor.requires_grad)
        else:
            module._buffers[attribute] = value
    model.tie_weights()
    still_meta = [name for name, *_, tensor in loaded_state(model) if tensor.is_meta]
    if still_meta:
        raise ValueError(f"{path}: the checkpoint holds no tensor for {', '.join(still_meta[:3])}")
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.config._name_or_path = str(path)
    return model.eval()
