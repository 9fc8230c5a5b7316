"""Tiny random decoders of each family the runtime supports, built in memory from a config (milliseconds)."""

from __future__ import annotations

import pytest
import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_hf_model(family: str = "llama", seed: int = 0, vocab_size: int = 256, **overrides):
    """A random transformers causal LM of ``family``: 2 layers, hidden 128, 4 heads over 2 KV heads."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    settings = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=family != "mistral",
        bos_token_id=1,
        eos_token_id=2,
    )
    config_class = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if family == "qwen3":
        settings["head_dim"] = 48
    config = config_class[family](**{**settings, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        # Default init (std 0.02) gives near-uniform logits; wider weights make the comparisons bite.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
            else:
                param.normal_(0, 0.08)
    return model


def tiny_family_model(family: str, seed: int = 0, vocab_size: int = 256, **overrides):
    """A random transformers causal LM of any family of ``tests/families.py`` (its settings, then ``overrides``),
    weights widened as ``tiny_hf_model``'s, every norm, bias, sink and routing bias random."""
    from transformers import AutoModelForCausalLM

    from tests.families import randomize_norms, tiny_config

    config = tiny_config(family, vocab_size, {"bos_token_id": 1, "eos_token_id": 2, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if param.dim() >= 2 and "norm" not in name:
                param.normal_(0, 0.08, generator=gen)
            elif name.endswith(("bias", "sinks")):
                param.normal_(0, 0.5, generator=gen)
    randomize_norms(model, seed)
    return model


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on one thread: on a shared CPU, 2-thread parallel regions of microsecond ops wait for a
    descheduled worker (about 10 ms per attention call measured here, 10x the whole single-thread decode)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
