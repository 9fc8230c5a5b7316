"""EAGLE-3 draft heads in the speculators format (vllm-project/speculators), as vLLM's EAGLE-3 loader reads them.

``config.json``: ``speculators_model_type: eagle3``, the draft layer's Llama config under
``transformer_layer_config``, ``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual``, the target
layers read (``eagle_aux_hidden_state_layer_ids``, vLLM's indexing: the residual stream entering that layer) and
``speculators_config`` (proposal method, tokens per round, the verifier). ``model.safetensors``: ``fc``, the
layer as ``layers.0.*`` (vLLM maps ``midlayer.`` there too), ``norm``, ``lm_head`` over the draft vocabulary,
``d2t`` (int64: target id = draft id + d2t) and ``t2d`` (bool over the target's vocabulary). No ``embed_tokens``:
vLLM then shares the target's embedding, as lmpress's drafter does. lmpress's own keys (the targets the head was
trained for, by fingerprint) sit under ``lmpress``, which vLLM ignores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lmpress.cache import files_fingerprint, write_json_atomic
from lmpress.errors import LmpressInputError

WEIGHTS = "model.safetensors"
TARGET_FILES = (".safetensors", ".gguf", ".onnx", ".data")  # and config.json: what a target's fingerprint covers
# lmpress's Eagle3Head parameter -> the speculators name
NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "layers.0.hidden_norm.weight",
    "input_layernorm.weight": "layers.0.input_layernorm.weight",
    "post_attention_layernorm.weight": "layers.0.post_attention_layernorm.weight",
    "q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "up_proj.weight": "layers.0.mlp.up_proj.weight",
    "down_proj.weight": "layers.0.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def speculators_config(head: dict[str, Any], verifier: str, architectures: list[str], tokens: int) -> dict[str, Any]:
    """The config.json of a head whose shape and targets are ``head`` (``Eagle3Config.as_dict``), verified by
    the model at ``verifier`` (its ``architectures``), drafting ``tokens`` per round."""
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": head["hidden_size"],
        "intermediate_size": head["intermediate_size"],
        "num_attention_heads": head["num_attention_heads"],
        "num_key_value_heads": head["num_key_value_heads"],
        "head_dim": head["head_dim"],
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": head["rms_norm_eps"],
        "rope_theta": head["rope_theta"],
        "max_position_embeddings": head["max_position_embeddings"],
        "vocab_size": head["vocab_size"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "float32",
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": head["draft_vocab_size"],
        "target_hidden_size": head["target_hidden_size"],
        "norm_before_residual": True,
        "eagle_aux_hidden_state_layer_ids": list(head["feature_layers"]),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": architectures},
        },
        "lmpress": {"targets": head.get("targets", {}), "feature_layers": list(head["feature_layers"])},
    }


def write_speculators(
    out: Path, config: dict[str, Any], state: dict[str, torch.Tensor], draft_tokens: torch.Tensor
) -> None:
    """Write a head's ``config`` (``speculators_config``) and weights (``state``: Eagle3Head's parameter names;
    ``draft_tokens``: the target id of each draft row, ascending) to the folder ``out``."""
    vocab = config["transformer_layer_config"]["vocab_size"]
    tensors = {NAMES[name]: state[name].detach().float().contiguous() for name in NAMES}
    rows = torch.arange(len(draft_tokens))
    tensors["d2t"] = (draft_tokens.long() - rows).contiguous()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_tokens.long()] = True
    tensors["t2d"] = t2d
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    write_json_atomic(out / "config.json", config)


def read_speculators(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], torch.Tensor]:
    """A head's config, weights (Eagle3Head's names) and draft tokens from a speculators folder, checked: an
    input error in one line for a folder that is not an EAGLE-3 head, a missing or misshapen tensor, or a
    vocabulary map that does not fit the target's vocabulary."""
    config_file, weights = path / "config.json", path / WEIGHTS
    if not config_file.is_file() or not weights.is_file():
        raise LmpressInputError(f"{path}: not a draft head (config.json and {WEIGHTS} expected)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise LmpressInputError(f"{config_file}: not JSON ({e})") from None
    if config.get("speculators_model_type") != "eagle3":
        raise LmpressInputError(
            f"{path}: speculators_model_type {config.get('speculators_model_type')!r}; lmpress drafts with eagle3"
        )
    try:
        tensors = load_file(str(weights))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise LmpressInputError(f"{weights}: unreadable ({e})") from None
    missing = [name for name in (*NAMES.values(), "d2t") if name not in tensors]
    if missing:
        raise LmpressInputError(f"{weights}: no {', '.join(missing)}: not a complete EAGLE-3 head")
    state = {ours: tensors[theirs] for ours, theirs in NAMES.items()}
    d2t = tensors["d2t"].long()
    draft_tokens = torch.arange(len(d2t)) + d2t
    vocab = config.get("transformer_layer_config", {}).get("vocab_size", 0)
    if len(d2t) != config.get("draft_vocab_size") or len(d2t) != state["lm_head.weight"].shape[0]:
        raise LmpressInputError(
            f"{path}: draft_vocab_size {config.get('draft_vocab_size')}, d2t {len(d2t)} and lm_head "
            f"{state['lm_head.weight'].shape[0]} rows disagree"
        )
    if len(d2t) > vocab or (len(d2t) and (draft_tokens.min() < 0 or draft_tokens.max() >= vocab)):
        raise LmpressInputError(
            f"{path}: its draft vocabulary ({len(d2t)} tokens, ids up to {int(draft_tokens.max())}) does not fit "
            f"the target's {vocab}"
        )
    if not bool((draft_tokens[1:] > draft_tokens[:-1]).all()):
        raise LmpressInputError(f"{path}: d2t maps two draft rows to one target token, or out of order")
    return config, state, draft_tokens


def export_fingerprint(path: Path) -> str | None:
    """sha256 over an export folder's config.json and weight files (None where it holds none): what a head records
    of each target it was trained for, and what lmpress checks when it drafts for one."""
    if not path.is_dir():
        return None
    files = sorted(p for p in path.iterdir() if p.is_file() and (p.suffix in TARGET_FILES or p.name == "config.json"))
    if not any(p.suffix in TARGET_FILES for p in files):
        return None
    return files_fingerprint(files)
