"""The runtime's tokenizer (``tokenizers`` alone) gives transformers' ids, text and chat prompts."""

from __future__ import annotations

import shutil

import pytest

from lmpress.errors import LmpressInputError
from lmpress.runtime.tokenizer import RuntimeTokenizer

TEXTS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Unicode: naïve café, 東京, emoji 🙂 — and   spaces.",
    "<|endoftext|> special in the middle <s> of text",
]
CHAT = [{"role": "user", "content": "Rewrite this.\n\n```python\nx = 1\n```"}]
TEMPLATE = (
    "{% for message in messages %}{{ bos_token + message['role'] + '\\n' + message['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}"
)


def _compare(path) -> None:
    from transformers import AutoTokenizer

    theirs, mine = AutoTokenizer.from_pretrained(path), RuntimeTokenizer(path)
    for text in TEXTS:
        for special in (False, True):
            ids = theirs(text, add_special_tokens=special)["input_ids"]
            assert mine(text, add_special_tokens=special)["input_ids"] == ids
            for skip in (False, True):
                assert mine.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert mine.get_vocab() == theirs.get_vocab() and len(mine) == len(theirs)
    assert (mine.eos_token_id, mine.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)
    if theirs.chat_template:
        for prompt in (False, True):
            expected = theirs.apply_chat_template(CHAT, add_generation_prompt=prompt, tokenize=False)
            assert mine.apply_chat_template(CHAT, add_generation_prompt=prompt, tokenize=False) == expected
            ids = theirs(expected, add_special_tokens=False)["input_ids"]
            assert mine.apply_chat_template(CHAT, add_generation_prompt=prompt) == ids


def test_same_as_transformers_on_a_tiny_bpe_tokenizer(tiny_llama_dir, tmp_path):
    path = tmp_path / "tok"
    shutil.copytree(tiny_llama_dir, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    _compare(path)


@pytest.mark.integration
def test_same_as_transformers_on_smollm2(smollm2_dir):
    _compare(smollm2_dir)


def test_missing_tokenizer_and_template_are_input_errors(tiny_llama_dir, tmp_path):
    with pytest.raises(LmpressInputError, match="no tokenizer.json"):
        RuntimeTokenizer(tmp_path)
    with pytest.raises(LmpressInputError, match="no chat template"):
        RuntimeTokenizer(tiny_llama_dir).apply_chat_template(CHAT)
