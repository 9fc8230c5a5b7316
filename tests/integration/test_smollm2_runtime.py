"""The runtime decoder on SmolLM2-135M against transformers on the same float weights (issue 11, part 1)."""

import pytest
import torch

from lmpress.data import load_text, tokenize
from lmpress.loader import load_model
from lmpress.runtime.generate import generate_tokens
from lmpress.runtime.model import Transformer

pytestmark = pytest.mark.integration


def test_runtime_logits_and_greedy_tokens_match_transformers(smollm2_dir):
    loaded = load_model(str(smollm2_dir))
    hf, tokenizer = loaded.model, loaded.tokenizer
    model = Transformer.from_hf(hf)
    ids = tokenize(tokenizer, load_text("builtin:wikitext2:test"))[:512].reshape(2, 256)
    with torch.no_grad():
        expected = hf(ids).logits
        actual = model(ids, model.new_cache(ids.shape[0], ids.shape[1]))
    torch.testing.assert_close(actual, expected, atol=2e-4, rtol=1e-4)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))

    prompt = ids[0, :64]
    with torch.no_grad():
        reference = hf.generate(prompt.reshape(1, -1), max_new_tokens=32, do_sample=False, eos_token_id=None)
    steps = list(generate_tokens(model, [prompt.tolist()], max_new_tokens=32, eos_token_id=None))
    assert [int(step[0]) for step in steps] == reference[0, 64:].tolist()
