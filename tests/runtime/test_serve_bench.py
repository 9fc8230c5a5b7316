"""bench/serve.py's lmpress worker on a tiny artifact of each head the bench writes (``--head float`` and ``w8``): it
loads, decodes, and names its head's kernel (an 8-bit head's kernel keeps codes, no ``weight``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import serve  # noqa: E402


@pytest.mark.parametrize("head", ["float", "w8"])
def test_the_lmpress_worker_decodes_either_head(tiny_llama_dir, tmp_path, monkeypatch, head):
    import lmpress
    from lmpress.registry import exporter

    loaded = lmpress.load_model(str(tiny_llama_dir))
    lmpress.quantize_model(loaded.model, method="rtn", group_size=64, **serve.SCHEME, **serve.HEADS[head])
    (tmp_path / "ct").mkdir()
    exporter("compressed-tensors")(loaded.model, loaded.tokenizer, tmp_path / "ct")
    monkeypatch.setattr(serve, "artifact_dir", lambda args: tmp_path)
    args = argparse.Namespace(threads=1, lmpress_dtype="float32", lmpress_eager=True)

    run, info = serve.engine_lmpress(args, [5, 6, 7, 8])

    assert ("W8A8RowLinear" in info["head"]) == (head == "w8")
    assert len(run(3, 1)[0]) == 3
