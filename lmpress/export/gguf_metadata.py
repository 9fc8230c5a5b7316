"""GGUF metadata lmpress writes: the general and architecture keys llama.cpp reads, and the byte-level BPE
tokenizer (vocabulary, token types, merges, the pre-tokenizer with the same splits, BOS/EOS, chat template).

``gguf.py`` writes the tensors; this module the key-value part of the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from torch import nn

from lmpress.errors import LmpressInputError

# tokenizer.json pre_tokenizer -> the llama.cpp pre-tokenizer with the same splits
GPT2_SPLIT = {"type": "ByteLevel", "use_regex": True}
DIGITS_SPLIT = {"type": "Digits", "individual_digits": True}
# Qwen2 / Qwen2.5 / Qwen3's split (single digits, case-insensitive contractions), then bytes: llama.cpp's "qwen2"
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = {"type": "Split", "pattern": {"Regex": QWEN2_REGEX}, "behavior": "Isolated", "invert": False}
BYTES_ONLY = {"type": "ByteLevel", "use_regex": False}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


def tokenizer_pre(tokenizer_json: dict[str, Any]) -> str:
    """The llama.cpp pre-tokenizer that splits text as ``tokenizer.json``'s pre_tokenizer does."""

    def matches(step: dict[str, Any], want: dict[str, Any]) -> bool:
        return all(step.get(k) == v for k, v in want.items())

    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and matches(steps[0], GPT2_SPLIT):
        return "gpt-2"
    if len(steps) == 2 and matches(steps[0], DIGITS_SPLIT) and matches(steps[1], GPT2_SPLIT):
        return "smollm"
    if len(steps) == 2 and matches(steps[0], QWEN2_SPLIT) and matches(steps[1], BYTES_ONLY):
        return "qwen2"
    raise LmpressInputError(
        f"export gguf: the tokenizer's pre-tokenizer ({json.dumps(pre)[:120]}) has no llama.cpp equivalent "
        "lmpress knows (byte-level GPT-2 splits, optionally with single digits; Qwen2's split)"
    )


def vocabulary(tokenizer: Any, n_vocab: int) -> dict[str, Any]:
    """Tokens, token types, merges and the pre-tokenizer of a byte-level BPE tokenizer, for ``n_vocab`` rows."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise LmpressInputError("export gguf: the tokenizer is not a fast (tokenizers) tokenizer; GGUF needs its BPE")
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise LmpressInputError(
            f"export gguf: only byte-level BPE tokenizers are written (this one is {model.get('type')!r} "
            f"with decoder {(spec.get('decoder') or {}).get('type')!r})"
        )
    vocab = tokenizer.get_vocab()
    if len(vocab) > n_vocab or max(vocab.values()) >= n_vocab:
        raise LmpressInputError(f"export gguf: the tokenizer has {len(vocab)} tokens, the model's embedding {n_vocab}")
    added = {t.content: t.special for t in tokenizer.added_tokens_decoder.values()}
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [TOKEN_UNUSED] * n_vocab
    for text, index in vocab.items():
        tokens[index] = text
        types[index] = TOKEN_NORMAL if text not in added else (TOKEN_CONTROL if added[text] else TOKEN_USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return {"tokens": tokens, "types": types, "merges": merges, "pre": tokenizer_pre(spec)}


def _adds(tokenizer: Any, token_id: int | None, first: bool) -> bool:
    if token_id is None:
        return False
    ids = tokenizer.encode("a", add_special_tokens=True)
    return bool(ids) and (ids[0] if first else ids[-1]) == token_id


def model_name(config: Any, tokenizer: Any) -> str:
    """general.name: the checkpoint's last path component. llama.cpp looks up ``</s>`` in the vocabulary of a model
    whose name contains "phi3" or "phi-3" (Phi-3's SentencePiece tokens) and fails to load one without it (Phi-4's
    byte-level BPE), so such a name loses that part."""
    name = Path(str(getattr(config, "_name_or_path", "") or config.model_type)).name or config.model_type
    if re.search(r"phi-?3", name, re.IGNORECASE) and "</s>" not in tokenizer.get_vocab():
        name = re.sub(r"phi-?3", "phi", name, flags=re.IGNORECASE)
    return name


def add_metadata(writer: Any, model: nn.Module, tokenizer: Any, file_type: int) -> None:
    """General, architecture and tokenizer keys llama.cpp reads."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_name(model_name(config, tokenizer))
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads))
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(int(head_dim))
    if head_dim * config.num_attention_heads != config.hidden_size:
        writer.add_key_length(int(head_dim))
        writer.add_value_length(int(head_dim))
    writer.add_vocab_size(int(config.vocab_size))
    writer.add_file_type(file_type)
    writer.add_quantization_version(2)

    vocab = vocabulary(tokenizer, int(config.vocab_size))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id)):
        token_id = getattr(tokenizer, f"{key}_token_id", None)
        if token_id is not None:
            add(int(token_id))
    if tokenizer.unk_token_id is not None:
        writer.add_unk_token_id(int(tokenizer.unk_token_id))
    if tokenizer.pad_token_id is not None:
        writer.add_pad_token_id(int(tokenizer.pad_token_id))
    writer.add_add_bos_token(_adds(tokenizer, tokenizer.bos_token_id, first=True))
    writer.add_add_eos_token(_adds(tokenizer, tokenizer.eos_token_id, first=False))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        writer.add_chat_template(template)
