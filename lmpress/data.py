"""Text for calibration and evaluation, and the token windows cut from it.

Sources:
  builtin:python-docs          the CPython reference text in ``pydoc_data.topics`` (always installed)
  builtin:python-source        the source of the standard library's top-level modules (``*.py`` in its
                               directory, sorted by name): code, as the running Python ships it
  builtin:wikitext2:test       WikiText-2's test split, raw (``wiki.test.raw``), shipped in the package
  builtin:wikitext2:valid      WikiText-2's validation split, tokenized form (``wiki.valid.tokens``)
  hf:DATASET[:CONFIG[:SPLIT]]  a hub dataset's ``text`` column, e.g. ``hf:wikitext:wikitext-2-raw-v1``
  PATH.txt | .jsonl | .parquet a local file (``text`` field / column for jsonl and parquet)

Every text is read as UTF-8 with CRLF turned into LF, tokenized once without
special tokens; windows and calibration samples are cut from that one stream,
deterministically for a given seed.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from lmpress.errors import LmpressInputError
from lmpress.memory import trim_c_heap

BUILTIN_PYTHON_DOCS = "builtin:python-docs"
BUILTIN_PYTHON_SOURCE = "builtin:python-source"
BUILTIN_WIKITEXT2 = "builtin:wikitext2"
# WikiText-2 (Merity et al. 2016; Wikipedia text, CC BY-SA 3.0): the files in lmpress/texts/wikitext2/, byte for
# byte those the measured tables used, so a builtin source scores the same numbers as the files did.
WIKITEXT2_SPLITS = {"valid": "wiki.valid.tokens", "test": "wiki.test.raw"}
BUILTIN_SOURCES = (
    BUILTIN_PYTHON_DOCS,
    BUILTIN_PYTHON_SOURCE,
    *(f"{BUILTIN_WIKITEXT2}:{split}" for split in WIKITEXT2_SPLITS),
)
TEXT_SUFFIXES = (".txt", ".raw", ".tokens", ".jsonl", ".parquet")


@dataclass(frozen=True)
class Text:
    source: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def load_text(source: str, default_split: str = "test") -> Text:
    """Read the whole text behind ``source``; a clear error when it is missing or empty."""
    if source.startswith("builtin:"):
        text = _builtin_text(source)
    elif source.startswith("hf:"):
        text = _hub_text(source, default_split)
    else:
        text = _file_text(Path(source))
    text = text.replace("\r\n", "\n")
    if not text.strip():
        raise LmpressInputError(f"text source {source} is empty")
    return Text(source, text)


def check_text_source(source: str) -> None:
    """Fail fast on a malformed source, or a local file that is missing, empty or unreadable (before long work)."""
    if source.startswith("builtin:"):
        _builtin_text(source)
    elif source.startswith("hf:"):
        _hub_parts(source)  # the dataset itself is fetched when it is used
    else:
        load_text(source)


def same_text(a: str, b: str) -> bool:
    """Whether sources ``a`` and ``b`` name the same text (local paths compared resolved)."""
    if a == b:
        return True
    if a.startswith(("builtin:", "hf:")) or b.startswith(("builtin:", "hf:")):
        return False
    return Path(a).resolve() == Path(b).resolve()


def _builtin_text(source: str) -> str:
    if source == BUILTIN_PYTHON_SOURCE:
        return _python_source()
    if source == BUILTIN_PYTHON_DOCS:
        return _python_docs()
    name, _, split = source.partition(":")[2].partition(":")
    if f"builtin:{name}" != BUILTIN_WIKITEXT2:
        raise LmpressInputError(f"unknown builtin text {source!r} (known: {', '.join(BUILTIN_SOURCES)})")
    splits = ", ".join(f"{BUILTIN_WIKITEXT2}:{s}" for s in WIKITEXT2_SPLITS)
    if not split:
        raise LmpressInputError(f"text source {source!r} needs a split: {splits}")
    if split not in WIKITEXT2_SPLITS:
        raise LmpressInputError(f"{BUILTIN_WIKITEXT2} has no split {split!r} (splits: {splits})")
    return wikitext2_bytes(split).decode("utf-8")


def wikitext2_bytes(split: str) -> bytes:
    """The packaged WikiText-2 file of ``split`` (``valid`` or ``test``), as shipped."""
    from importlib.resources import files

    return (files("lmpress.texts") / "wikitext2" / WIKITEXT2_SPLITS[split]).read_bytes()


def _python_source() -> str:
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise LmpressInputError(f"{BUILTIN_PYTHON_SOURCE}: no standard library sources in {stdlib}")
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def _python_docs() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def _file_text(path: Path) -> str:
    if not path.exists():
        raise LmpressInputError(f"text file {path} does not exist")
    if not path.is_file():
        raise LmpressInputError(f"text file {path} is not a file")
    if path.suffix not in TEXT_SUFFIXES:
        raise LmpressInputError(f"text file {path}: unsupported type {path.suffix!r} (use {', '.join(TEXT_SUFFIXES)})")
    if path.suffix == ".jsonl":
        return _jsonl_text(path)
    if path.suffix == ".parquet":
        return _parquet_text(path)
    return _utf8_text(path)


def _utf8_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LmpressInputError(
            f"text file {path}: not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); convert it to UTF-8"
        ) from e


def _jsonl_text(path: Path) -> str:
    """The ``text`` field of every line (one JSON object a line); errors name the line."""
    texts = []
    for number, line in enumerate(_utf8_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise LmpressInputError(f"{path}: line {number} is not valid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(row, dict):
            raise LmpressInputError(f"{path}: line {number} is {type(row).__name__}, not a JSON object with 'text'")
        if "text" not in row:
            raise LmpressInputError(f"{path}: line {number} has no 'text' field")
        texts.append(str(row["text"]))
    return "\n\n".join(texts)


def _parquet_text(path: Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise LmpressInputError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from e
    if "text" not in table.column_names:
        raise LmpressInputError(f"{path}: no 'text' column (columns: {', '.join(table.column_names)})")
    return "\n\n".join(str(t) for t in table.column("text").to_pylist())


def _hub_parts(source: str) -> tuple[str, str | None, str | None]:
    """``hf:DATASET[:CONFIG[:SPLIT]]`` as (dataset, config, split)."""
    parts = source.removeprefix("hf:").split(":")
    if not parts[0] or len(parts) > 3:
        raise LmpressInputError(f"text source {source!r}: expected hf:DATASET[:CONFIG[:SPLIT]]")
    name, config, split = (parts + [None, None])[:3]
    return name, config, split


def _hub_text(source: str, default_split: str) -> str:
    name, config, split = _hub_parts(source)
    try:
        import datasets
    except ImportError as e:
        raise LmpressInputError(f"text source {source} needs the datasets package: pip install datasets") from e
    try:
        rows = datasets.load_dataset(name, config, split=split or default_split)
    except Exception as e:  # datasets raises many types for "unreachable" and "unknown"
        raise LmpressInputError(
            f"cannot load dataset {source} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "offline, use a local .txt/.jsonl/.parquet file or builtin:python-docs"
        ) from e
    if "text" not in rows.column_names:
        raise LmpressInputError(f"dataset {source} has no 'text' column (columns: {rows.column_names})")
    return "\n\n".join(rows["text"])


# each tokenizer's last few texts' ids (a run tokenizes its calibration and eval texts more than once); an entry
# dies with its tokenizer, where a cache keyed by the tokenizer would keep every tokenizer a process made alive
_token_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
TEXTS_KEPT_PER_TOKENIZER = 4


def tokenize(tokenizer, text: Text) -> torch.Tensor:
    """The whole text as one 1-D stream of token ids, without special tokens."""
    kept = _token_ids.setdefault(tokenizer, {})
    ids = kept.pop(text.text, None)
    if ids is None:
        ids = torch.tensor(
            tokenizer(text.text, add_special_tokens=False, return_attention_mask=False)["input_ids"], dtype=torch.long
        )
        # the tokenizer's transient buffers go back to the OS: after WikiText-2's test text (SmolLM2's tokenizer) the
        # process held 121 MiB more than before, 27 with them handed back
        trim_c_heap()
    kept[text.text] = ids  # the most recent last
    while len(kept) > TEXTS_KEPT_PER_TOKENIZER:
        del kept[next(iter(kept))]
    return ids.clone()  # the caller's own: a write into it must not change the next caller's (2.4 MB, WikiText-2)


def token_windows(
    ids: torch.Tensor,
    seq_len: int,
    n_windows: int | None = None,
    stride: int | None = None,
    bos_token_id: int | None = None,
    where: str = "text",
) -> torch.Tensor:
    """Windows of ``seq_len`` tokens starting every ``stride`` tokens (default: non-overlapping).

    With ``bos_token_id`` each window is BOS followed by ``seq_len - 1`` text tokens (and the
    default stride is ``seq_len - 1``, so the text pieces still tile the stream).
    ``n_windows=None`` takes every full window. ``where`` (e.g. ``eval.perplexity``) starts the error messages.
    """
    body = seq_len - (bos_token_id is not None)
    stride = stride or body
    available = 0 if ids.numel() < body else (ids.numel() - body) // stride + 1
    if available == 0:
        raise LmpressInputError(
            f"{where}: the text has {ids.numel()} tokens, fewer than one window of {seq_len} (use a longer text)"
        )
    if n_windows is not None and n_windows > available:
        raise LmpressInputError(
            f"{where}: the text has {ids.numel()} tokens: {available} windows of {seq_len} (stride {stride}), "
            f"not {n_windows}"
        )
    count = available if n_windows is None else n_windows
    starts = torch.arange(count) * stride
    windows = ids[starts[:, None] + torch.arange(body)]
    if bos_token_id is not None:
        windows = torch.cat([torch.full((count, 1), bos_token_id, dtype=ids.dtype), windows], dim=1)
    return windows


def calibration_samples(ids: torch.Tensor, n_samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """``n_samples`` distinct non-overlapping chunks of ``seq_len`` tokens, chosen by ``seed``."""
    chunks = ids.numel() // seq_len
    if chunks < n_samples:
        raise LmpressInputError(
            f"calibration text too short: {ids.numel()} tokens give {chunks} samples of {seq_len} tokens, "
            f"{n_samples} requested (use more text, fewer samples or shorter samples)"
        )
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(chunks, generator=generator)[:n_samples].sort().values
    return ids[: chunks * seq_len].view(chunks, seq_len)[chosen].clone()
