"""The embedding table of a checkpoint the runtime reads in place keeps none of its pages resident after a
lookup, eager or compiled, and gives the same rows and logits as a copied table."""

import mmap
import struct
import sys

import pytest
import torch
import torch.nn.functional as F

from lmpress.runtime.checkpoint import load_checkpoint
from lmpress.runtime.generate import compiled_forward, model_forward
from lmpress.runtime.mapped_embedding import MappedEmbedding
from lmpress.runtime.model import Transformer
from tests.runtime.conftest import tiny_hf_model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")


def present_pages(table: torch.Tensor) -> int:
    """Pages wholly inside ``table`` mapped into this process now (bit 63 of their /proc/self/pagemap entries;
    the two pages at its ends are shared with the tensors beside it in the file, and kept)."""
    first = -(-table.data_ptr() // mmap.PAGESIZE)
    end = (table.data_ptr() + table.numel() * table.element_size()) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = struct.unpack(f"{end - first}Q", pagemap.read((end - first) * 8))
    return sum(entry >> 63 for entry in entries)


@pytest.fixture
def untied(tmp_path):
    # 4,096 rows of 128 float32: 512 pages, so that rows far apart lie on pages of their own
    hf = tiny_hf_model("mistral", seed=1, vocab_size=4096)
    hf.save_pretrained(tmp_path)
    return hf, load_checkpoint(tmp_path)


TOKENS = torch.tensor([[5, 700, 1500, 2300, 3100, 4000, 17, 2900]])


def test_a_lookup_leaves_none_of_the_table_resident(untied):
    _, model = untied
    table = model.tok_embeddings.weight
    assert isinstance(model.tok_embeddings, MappedEmbedding)
    F.embedding(TOKENS, table)  # a plain lookup maps the rows' pages, and more around them
    assert present_pages(table) >= TOKENS.numel()
    rows = model.tok_embeddings(TOKENS)
    assert present_pages(table) == 0
    torch.testing.assert_close(rows, F.embedding(TOKENS, table.clone()), rtol=0, atol=0)


@pytest.mark.long
def test_decoding_eager_and_compiled_keeps_the_table_out_and_the_logits(untied):
    hf, model = untied
    with torch.no_grad():
        expected = hf(TOKENS).logits
    for forward in (model_forward, compiled_forward()):
        logits = forward(model, TOKENS, model.new_cache(1, 16))
        assert present_pages(model.tok_embeddings.weight) == 0
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_tied_or_copied_tables_stay_plain_embeddings(tmp_path):
    tiny_hf_model("llama", seed=1).save_pretrained(tmp_path / "tied")  # the table is the output layer too
    tied = load_checkpoint(tmp_path / "tied")
    assert type(tied.tok_embeddings) is torch.nn.Embedding
    assert tied.output.weight is tied.tok_embeddings.weight
    copied = Transformer.from_hf(tiny_hf_model("mistral", seed=1))  # in memory: nothing to drop
    assert type(copied.tok_embeddings) is torch.nn.Embedding


def test_a_table_cast_since_its_load_is_looked_up_and_never_dropped(untied):
    # a cast (or a move to a GPU) copies the table out of the file: dropping those pages would zero it
    _, model = untied
    embedding = model.tok_embeddings.to(torch.float64)
    expected = embedding.weight[TOKENS].clone()
    for _ in range(2):
        torch.testing.assert_close(embedding(TOKENS), expected, rtol=0, atol=0)


# Prints the inductor cache key of the first graph a compiled read of a checkpoint makes, then stops.
CACHE_KEY = """
import sys
import torch
import torch._inductor.codecache as codecache
real = codecache.compiled_fx_graph_hash
def key_only(*args, **kwargs):
    print(real(*args, **kwargs)[0], flush=True)
    raise SystemExit(0)
codecache.compiled_fx_graph_hash = key_only
from lmpress.runtime.checkpoint import load_checkpoint
from lmpress.runtime.generate import compiled_forward
model = load_checkpoint(sys.argv[1])
compiled_forward()(model, torch.tensor([[5, 700]]), model.new_cache(1, 16))
"""


@pytest.mark.long
def test_a_compiled_step_over_a_mapped_table_is_found_in_inductors_cache_by_a_new_process(untied, tmp_path):
    """The table's address is no constant of the graph (it was: every process's key differed, and SmolLM2's step
    compiled for 58 s at every `lmpress generate --compile`; a second process now reuses the first's work)."""
    import subprocess

    checkpoint = tmp_path  # the fixture saved the checkpoint here
    keys = [
        subprocess.run(
            [sys.executable, "-c", CACHE_KEY, str(checkpoint)], capture_output=True, text=True, timeout=600, check=True
        ).stdout.split()[-1]
        for _ in range(2)
    ]
    assert keys[0] == keys[1]
