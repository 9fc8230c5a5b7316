"""Fixtures for the eval tests: a loaded tiny Llama and eval contexts over the builtin text."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmpress.data import BUILTIN_PYTHON_DOCS, load_text, tokenize
from lmpress.registry import EvalContext


@pytest.fixture(scope="session")
def tiny(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    return model, tokenizer


@pytest.fixture(scope="session")
def docs_text():
    return load_text(BUILTIN_PYTHON_DOCS)


def make_ctx(text, tokenizer, role: str, store: Path) -> EvalContext:
    return EvalContext(text=text, ids=cache(lambda: tokenize(tokenizer, text)), role=role, store=store)


def perturbed(model: torch.nn.Module, scale: float, seed: int = 1) -> torch.nn.Module:
    """A copy of ``model`` with relative Gaussian noise of ``scale`` on every linear weight (a stand-in candidate)."""
    import copy

    clone = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in clone.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                w += scale * w.abs().mean() * torch.randn(w.shape, generator=generator)
    return clone
