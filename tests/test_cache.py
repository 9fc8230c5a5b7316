"""lmpress.cache: file hashes memoized by what the file system says about a file, never trusted past a change."""

import hashlib
import os

import pytest

from lmpress import cache
from lmpress.cache import files_fingerprint, known_sha256


@pytest.fixture
def old_file(tmp_path, private_cache, monkeypatch):
    monkeypatch.setattr(cache, "RACY_SECONDS", -1.0)  # every file counts as settled, however new
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"weights" * 1000)
    return path


def test_an_unchanged_file_is_hashed_once(old_file, monkeypatch):
    assert known_sha256(old_file) == hashlib.sha256(old_file.read_bytes()).hexdigest()

    def no_second_read(path, chunk=0):
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(cache, "sha256_file", no_second_read)
    assert known_sha256(old_file) == hashlib.sha256(old_file.read_bytes()).hexdigest()


def test_a_rewrite_of_the_same_size_and_time_is_hashed_again(old_file):
    before = known_sha256(old_file)
    times = os.stat(old_file)
    old_file.write_bytes(b"WEIGHTS" * 1000)  # same size; its modification time set back below
    os.utime(old_file, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert os.stat(old_file).st_mtime_ns == times.st_mtime_ns and os.stat(old_file).st_size == times.st_size
    assert known_sha256(old_file) == hashlib.sha256(b"WEIGHTS" * 1000).hexdigest() != before


def test_a_file_replaced_by_another_is_hashed_again(old_file, tmp_path):
    known_sha256(old_file)
    other = tmp_path / "other"
    other.write_bytes(b"weighs!" * 1000)
    os.replace(other, old_file)
    assert known_sha256(old_file) == hashlib.sha256(b"weighs!" * 1000).hexdigest()


def test_a_file_changed_just_now_is_not_remembered(tmp_path, private_cache, cache_dir):
    path = tmp_path / "fresh"
    path.write_bytes(b"x" * 100)
    assert known_sha256(path) == hashlib.sha256(b"x" * 100).hexdigest()
    assert not (cache_dir / "sha256").exists() or not any((cache_dir / "sha256").iterdir())


def test_files_fingerprint_names_and_contents(old_file, tmp_path):
    twin = tmp_path / "twin"
    twin.mkdir()
    (twin / old_file.name).write_bytes(old_file.read_bytes())
    assert files_fingerprint([old_file]) == files_fingerprint([twin / old_file.name])
    (twin / "config.json").write_text("{}")
    assert files_fingerprint([old_file]) != files_fingerprint([twin / old_file.name, twin / "config.json"])
