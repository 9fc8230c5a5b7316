"""SmolLM2-135M on the reference perplexity protocol (lmpress/texts/wikitext2/README.md; docs/results.md)."""

import pytest

from lmpress.data import load_text, tokenize
from lmpress.evals.perplexity import PerplexityConfig, perplexity
from lmpress.loader import load_model

pytestmark = pytest.mark.integration


@pytest.mark.long
def test_fp32_perplexity_reproduces_reference(smollm2_dir):
    loaded = load_model(str(smollm2_dir))
    config = PerplexityConfig(seq_len=2048, windows=20, batch_size=4)
    ids = tokenize(loaded.tokenizer, load_text("builtin:wikitext2:test"))
    assert ids.numel() == 301948  # the whole test split, tokenized once without special tokens
    result = perplexity(loaded.model, config.windows_for(ids, loaded.tokenizer), config)
    assert result["ppl"] == pytest.approx(20.97, abs=0.05)
    assert result["scored_tokens"] == 20 * 2047
