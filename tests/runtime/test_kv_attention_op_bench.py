"""bench/kv_attention_op.py (issue 50's per-layer timings of the CPU cache-attention op): its rows, and the bytes its
GB/s divides by, as a cache of SmolLM2's shape holds them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lmpress.runtime.kernels import cpu_kv_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kv_attention_op  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_kv_attention.available(), reason="needs the C++ library and AVX2")


def test_times_every_cache_and_row_count_and_files_them_by_host(tmp_path):
    argv = ["--rounds", "2", "--calls", "3", "--rows", "1", "3", "--layers", "2", "--fill", "1000"]
    assert kv_attention_op.main([*argv, "--results", str(tmp_path)]) == 0
    (entry,) = json.loads((tmp_path / "kv_attention_op.json").read_text()).values()
    rows = {(r["stored"], r["rows"]): r for r in entry["rows"]}
    assert set(rows) == {(s, r) for s in ("float32", "int8", "fp8", "int4", "int4-kivi") for r in (1, 3)}
    assert all(len(r["us"]) == 2 and min(r["us"]) > 0 for r in rows.values())
    # per filled slot, keys and values of 3 KV heads of 64: float32 4 bytes an entry; int8 1 byte and a float32
    # scale per slot and head; FP8 1 byte (its scales are static, per head); INT4 half a byte and a float16 step and
    # minimum per slot and head; KIVI's keys a float16 step and minimum per channel and 32 slots instead
    per_slot = {
        "float32": 2 * 3 * 64 * 4,
        "int8": 2 * 3 * (64 + 4),
        "fp8": 2 * 3 * 64,
        "int4": 2 * 3 * (32 + 4),
        "int4-kivi": 3 * (32 + 2 * 64 * 2 // 32) + 3 * (32 + 4),
    }
    assert {s: rows[s, 1]["bytes"] for s in per_slot} == {s: 1000 * b for s, b in per_slot.items()}
    page = (tmp_path / "kv_attention_op.md").read_text()
    assert "| int8 | 3 |" in page and "1000 of 4096 slots filled" in page


@pytest.mark.long
def test_against_a_revision_times_both_ops_in_the_same_rounds_and_files_nothing(tmp_path, capsys):
    argv = ["--rounds", "2", "--calls", "2", "--rows", "3", "--layers", "1", "--fill", "300", "--against", "HEAD"]
    assert kv_attention_op.main([*argv, "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2 and all("int8 R3 @HEAD" in line and "int8 R3 " in line for line in rounds)
    ratios = [line for line in out.splitlines() if "now / HEAD = " in line]
    assert [line.split(":")[0] for line in ratios] == [f"{s}, 3 row(s)" for s in ("float32", "int8", "fp8")]
    assert all(float(line.rsplit("= ", 1)[1]) > 0 for line in ratios)
    assert not list(tmp_path.iterdir())
