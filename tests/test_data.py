import gc
import hashlib
import json

import pytest
import torch

from lmpress.data import (
    Text,
    _token_ids,
    calibration_samples,
    check_text_source,
    load_text,
    token_windows,
    tokenize,
    wikitext2_bytes,
)
from lmpress.errors import LmpressInputError


def test_builtin_python_docs_is_deterministic():
    a, b = load_text("builtin:python-docs"), load_text("builtin:python-docs")
    assert len(a.text) > 100_000 and a.sha256 == b.sha256 and "\r\n" not in a.text


def test_builtin_python_source_is_the_standard_librarys_code():
    a, b = load_text("builtin:python-source"), load_text("builtin:python-source")
    assert len(a.text) > 1_000_000 and a.sha256 == b.sha256
    assert "class Fraction(" in a.text  # fractions.py
    assert "def namedtuple(" not in a.text  # collections is a package: only top-level modules are read


# Published size and sha256 of each WikiText-2 file (the wikitext-2-raw-v1 test split; the wikitext-2-v1
# validation split, tokenized form), as the measured tables and the shared data's README record them.
WIKITEXT2 = {
    "test": (1_290_547, "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"),
    "valid": (1_121_681, "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8"),
}


@pytest.mark.parametrize("split", sorted(WIKITEXT2))
def test_builtin_wikitext2_is_the_measured_file_byte_for_byte(split):
    raw = wikitext2_bytes(split)
    size, digest = WIKITEXT2[split]
    assert len(raw) == size and hashlib.sha256(raw).hexdigest() == digest
    text = load_text(f"builtin:wikitext2:{split}")
    assert text.text == raw.decode("utf-8").replace("\r\n", "\n")  # what load_text of the file itself gives


def test_builtin_wikitext2_splits_are_the_raw_test_and_tokenized_valid_text():
    test, valid = load_text("builtin:wikitext2:test").text, load_text("builtin:wikitext2:valid").text
    assert test.startswith(" = Robert Boulter = \n") and "<unk>" not in test
    assert valid.startswith(" \n = Homarus gammarus = \n") and valid.count("<unk>") > 1000


def test_builtin_wikitext2_is_package_data_of_a_built_wheel(tmp_path):
    """A non-editable install carries the two files: they are listed in the wheel's RECORD."""
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(repo),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("lmpress-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        for split, name in (("test", "wiki.test.raw"), ("valid", "wiki.valid.tokens")):
            assert archive.read(f"lmpress/texts/wikitext2/{name}") == wikitext2_bytes(split)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "builtin:nope",
            "unknown builtin text 'builtin:nope' (known: builtin:python-docs, builtin:python-source, "
            "builtin:wikitext2:valid, builtin:wikitext2:test)",
        ),
        ("builtin:python-docs:test", "unknown builtin text 'builtin:python-docs:test' (known: "),
        (
            "builtin:wikitext2:train",
            "builtin:wikitext2 has no split 'train' (splits: builtin:wikitext2:valid, builtin:wikitext2:test)",
        ),
        (
            "builtin:wikitext2",
            "text source 'builtin:wikitext2' needs a split: builtin:wikitext2:valid, builtin:wikitext2:test",
        ),
        ("builtin:wikitext2:", "needs a split"),
    ],
)
def test_bad_builtin_sources_name_what_exists(source, message):
    for read in (load_text, check_text_source):
        with pytest.raises(LmpressInputError) as raised:
            read(source)
        assert message in str(raised.value) and "\n" not in str(raised.value)


def test_local_files(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"line one\r\nline two\r\n")
    assert load_text(str(tmp_path / "a.txt")).text == "line one\nline two\n"
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ["x", "y"]))
    assert load_text(str(tmp_path / "b.jsonl")).text == "x\n\ny"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["p", "q"]}), tmp_path / "c.parquet")
    assert load_text(str(tmp_path / "c.parquet")).text == "p\n\nq"


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.txt", None, "does not exist"),
        ("empty.txt", "  \n", "is empty"),
        ("bad.jsonl", '{"txt": 1}\n', "no 'text' field"),
        ("bad.csv", "a,b", "unsupported type"),
        ("latin1.txt", b"caf\xe9 ok", r"latin1.txt: not UTF-8 \(byte 0xe9 at offset 3\)"),
        ("latin1.jsonl", b'{"text": "caf\xe9"}', r"latin1.jsonl: not UTF-8 \(byte 0xe9 at offset 13\)"),
        ("broken.jsonl", '{"text": "a"}\n\n{"text": \n', r"broken.jsonl: line 3 is not valid JSON"),
        ("list.jsonl", '{"text": "a"}\n["b"]\n', r"list.jsonl: line 2 is list, not a JSON object"),
        ("string.jsonl", '"just text"\n', r"string.jsonl: line 1 is str, not a JSON object"),
        ("bad.parquet", "not parquet at all", "not a readable parquet file"),
    ],
)
def test_bad_text_sources(tmp_path, name, content, message):
    if isinstance(content, bytes):
        (tmp_path / name).write_bytes(content)
    elif content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(LmpressInputError, match=message):
        load_text(str(tmp_path / name))
    with pytest.raises(LmpressInputError, match="unknown builtin"):
        load_text("builtin:nope")


def test_check_text_source_reads_local_files_up_front(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"fine text " * 100 + b"\xff")
    with pytest.raises(LmpressInputError, match="byte 0xff at offset 1000"):
        check_text_source(str(tmp_path / "bad.txt"))
    with pytest.raises(LmpressInputError, match="is not a file"):
        check_text_source(str(tmp_path))
    check_text_source("hf:anything")  # hub sources are read when used


def test_windows_are_non_overlapping_and_counted():
    ids = torch.arange(100)
    windows = token_windows(ids, 10, 3)
    assert windows.tolist()[1] == list(range(10, 20)) and windows.shape == (3, 10)
    assert token_windows(ids, 10).shape == (10, 10)
    assert token_windows(ids, 10, stride=5).shape == (19, 10)
    with_bos = token_windows(ids, 10, 2, bos_token_id=-1)
    assert with_bos[1].tolist() == [-1, *range(9, 18)]
    with pytest.raises(LmpressInputError, match="10 windows of 10"):
        token_windows(ids, 10, 11)
    with pytest.raises(LmpressInputError, match="fewer than one window"):
        token_windows(ids, 200)


def test_calibration_samples_are_seeded_distinct_chunks():
    ids = torch.arange(1000)
    a, b, c = (calibration_samples(ids, 8, 50, seed) for seed in (0, 0, 1))
    assert torch.equal(a, b) and not torch.equal(a, c)
    starts = a[:, 0]
    assert len(set(starts.tolist())) == 8 and all(s % 50 == 0 for s in starts.tolist())
    with pytest.raises(LmpressInputError, match="calibration text too short"):
        calibration_samples(ids, 30, 50, 0)


class CountingTokenizer:
    """One id per character; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, text, add_special_tokens, return_attention_mask):
        self.calls += 1
        return {"input_ids": [ord(c) for c in text]}


def test_tokenize_reuses_a_texts_ids_and_forgets_them_with_the_tokenizer():
    tokenizer = CountingTokenizer()
    texts = [Text(text=f"text {i}", source=f"s{i}") for i in range(6)]
    first = tokenize(tokenizer, texts[0])
    assert first.tolist() == [ord(c) for c in "text 0"]
    first[0] = -1  # a caller writing into its ids (masking a token) leaves the next caller's as tokenized
    assert tokenize(tokenizer, texts[0]).tolist() == [ord(c) for c in "text 0"] and tokenizer.calls == 1
    for text in texts[1:]:  # the oldest texts make way
        tokenize(tokenizer, text)
    assert tokenize(tokenizer, texts[5]) is not None and tokenizer.calls == 6
    tokenize(tokenizer, texts[0])
    assert tokenizer.calls == 7
    del tokenizer
    gc.collect()
    assert not any(isinstance(t, CountingTokenizer) for t in _token_ids.keys())
