"""The tokenizer of a checkpoint directory, read with the ``tokenizers`` library alone.

transformers' ``AutoTokenizer`` wraps the same ``tokenizer.json`` but importing and
building it costs over 100 MB of resident memory, more than a 4-bit SmolLM2's weights.
``RuntimeTokenizer`` gives the runtime what it uses of it (encode, decode, special
token ids, the vocabulary, the chat template rendered with jinja2 as transformers
renders it), with the same ids and text (tested against ``AutoTokenizer``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmpress.errors import LmpressInputError


class RuntimeTokenizer:
    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise LmpressInputError(f"{path}: no tokenizer.json (the runtime reads fast tokenizers only)")
        self.backend = Tokenizer.from_file(str(file))
        settings = _read_json(path / "tokenizer_config.json")
        generation = {**_read_json(path / "config.json"), **_read_json(path / "generation_config.json")}
        self.bos_token = _token_text(settings.get("bos_token"))
        self.eos_token = _token_text(settings.get("eos_token"))
        self.eos_token_id = self._id_of(self.eos_token, generation.get("eos_token_id"))
        self.bos_token_id = self._id_of(self.bos_token, generation.get("bos_token_id"))
        self.clean_up_spaces = bool(settings.get("clean_up_tokenization_spaces", False))
        template = path / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else settings.get("chat_template")

    def _id_of(self, token: str | None, fallback: Any) -> int | None:
        found = self.backend.token_to_id(token) if token else None
        if found is not None:
            return found
        return fallback[0] if isinstance(fallback, list) and fallback else fallback

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_spaces else text

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = False, tokenize: bool = True
    ) -> str | list[int]:
        """The chat rendered as transformers renders it (a sandboxed jinja2 template, trimmed blocks)."""
        if not self.chat_template:
            raise LmpressInputError("this tokenizer has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise LmpressInputError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _read_json(file: Path) -> dict[str, Any]:
    from lmpress.checkpoint_files import read_json_file

    return read_json_file(file) if file.is_file() else {}


def _token_text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _clean_up_spaces(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before punctuation and English contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'")):
        text = text.replace(before, after)
    for suffix in ("n't", "'m", "'s", "'ve", "'re"):
        text = text.replace(f" {suffix}", suffix)
    return text
