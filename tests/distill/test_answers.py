from __future__ import annotations

import pytest
import torch

from lmpress.data import load_text, tokenize
from lmpress.distill.answers import TeacherAnswers, chat_prompt_ids, teacher_answer_windows
from lmpress.errors import LmpressInputError
from lmpress.loader import load_model

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@pytest.fixture
def teacher(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir))
    loaded.tokenizer.chat_template = TEMPLATE
    ids = tokenize(loaded.tokenizer, load_text("builtin:python-docs"))[:4000]
    return loaded.model.eval(), loaded.tokenizer, ids


def greedy(model, prompt: list[int], new: int, eos: int) -> list[int]:
    """The reference: one full forward per token, the end token held back as the stage asks."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([seq])).logits[0, -1]
            logits[eos] = float("-inf")
            seq.append(int(logits.argmax()))
    return seq


def test_each_window_is_a_chat_prompt_quoting_the_text_and_the_teachers_greedy_answer(teacher, tmp_path):
    model, tokenizer, ids = teacher
    config = TeacherAnswers(prompts=3, quote_tokens=16, instructions=["Summarize.", "Say it again."], batch_size=2)
    windows = teacher_answer_windows(model, tokenizer, ids, config, 64, 0, tmp_path, torch.device("cpu"))
    assert windows.shape == (3, 64)
    text = ids.tolist()
    for i, row in enumerate(windows.tolist()):
        instruction = config.instructions[i % 2]
        prefix = tokenizer(f"<s>user\n{instruction}\n\n", add_special_tokens=False)["input_ids"]
        quote = row[len(prefix) : len(prefix) + 16]
        assert any(text[s : s + 16] == quote for s in range(len(text) - 15))  # a passage of the training text
        prompt = chat_prompt_ids(tokenizer, instruction, quote)
        assert row[: len(prompt)] == prompt
        assert row == greedy(model, prompt, 64 - len(prompt), tokenizer.eos_token_id)


def test_the_answers_are_kept_for_a_resumed_run(teacher, tmp_path, monkeypatch):
    model, tokenizer, ids = teacher
    config = TeacherAnswers(prompts=2, quote_tokens=8)
    first = teacher_answer_windows(model, tokenizer, ids, config, 96, 0, tmp_path, torch.device("cpu"))
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("answers generated again"))
    again = teacher_answer_windows(model, tokenizer, ids, config, 96, 0, tmp_path, torch.device("cpu"))
    assert torch.equal(first, again)


def test_bad_settings_say_what_to_change(teacher, tmp_path):
    model, tokenizer, ids = teacher
    with pytest.raises(LmpressInputError, match="lower quote_tokens or raise seq_len"):
        teacher_answer_windows(model, tokenizer, ids, TeacherAnswers(quote_tokens=64), 64, 0, tmp_path, "cpu")
    tokenizer.chat_template = None
    with pytest.raises(LmpressInputError, match="needs a tokenizer with a chat template"):
        teacher_answer_windows(model, tokenizer, ids, TeacherAnswers(quote_tokens=8), 64, 0, tmp_path, "cpu")
