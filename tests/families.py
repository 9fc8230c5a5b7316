"""Tiny random models of every architecture family the support matrix covers, built offline from transformers'
own config classes (seconds each).

Each keeps its family's quirks switched on and visible at this size: sliding windows shorter than the
calibration samples, Gemma's soft-capping set where it bends the values, every norm's weight random (a
(1 + weight) norm read as weight, or a sandwich norm skipped, changes the logits), two rope thetas, MoE
routers over several experts.
"""

from __future__ import annotations

from pathlib import Path

import torch

# family -> (config class name, settings beyond the common ones)
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 4, 2, 16
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", {"head_dim": HEAD_DIM}),
    "opt": ("OPTConfig", {"ffn_dim": INTERMEDIATE, "word_embed_proj_dim": HIDDEN}),
    "phi3": ("Phi3Config", {"num_key_value_heads": HEADS}),  # Phi-3-mini's layout: MHA, fused qkv and gate_up
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": HEAD_DIM,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 0.02,
            "final_logit_softcapping": 0.8,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "head_dim": HEAD_DIM,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"head_dim": HEAD_DIM, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "num_key_value_heads": HEADS,  # MLA expands its one latent into every head's keys and values
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 32,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "gpt_oss": (
        "GptOssConfig",
        {
            "head_dim": HEAD_DIM,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
    ),
}


def tiny_config(family: str, vocab_size: int, special: dict):
    import transformers

    class_name, settings = FAMILIES[family]
    common = {
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 256,
    }
    if family == "opt":
        common = {k: v for k, v in common.items() if k not in ("intermediate_size", "num_key_value_heads")}
        special = {**special, "pad_token_id": 1}
    return getattr(transformers, class_name)(**{**common, **settings, **special})


def randomize_norms(model: torch.nn.Module, seed: int) -> None:
    """Every norm weight random around its family's identity (1 for x * w, 0 for Gemma's x * (1 + w)); attention
    sinks and expert and routing biases random."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if p.dim() == 1 and "norm" in name and name.endswith("weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("sinks", "_proj_bias", "e_score_correction_bias")):
                # gpt-oss's attention sinks and expert biases, DeepSeek-V3's routing bias: initialized to (near)
                # zero, where dropping them would not show
                p.add_(0.5 * torch.randn(p.shape, generator=gen))


def save_family_model(path: Path, family: str, tokenizer, seed: int = 0) -> Path:
    """A tiny random ``family`` model with ``tokenizer``, saved as an HF checkpoint at ``path``."""
    from transformers import AutoModelForCausalLM

    special = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.eos_token_id,
    }
    config = tiny_config(family, len(tokenizer), special)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    randomize_norms(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
