"""An embedding table read in place from a memory-mapped checkpoint, its pages dropped after each lookup.

A decode step reads one row of the table (2,304 bytes for SmolLM2 in float32), but the first touch of
a row maps the kernel's read-around of the file into the process, about 200 KiB per row in a
one-off measurement here (300 random rows of SmolLM2's table: +62 MiB resident). Over a generation
of varied text those windows add up toward the whole table (113 MiB for SmolLM2; a process decoding
bench/runtime.py's W4 prompt 8 times held 26 MiB of it, in /proc/self/smaps). Dropping the table's
pages once its rows are copied keeps one lookup's rows resident, for about 10 us a step (one
``madvise``, and the next lookup's page faults; a one-off timing).

The pages are the file's own: the mapping is copy-on-write and nothing writes the table, so dropping
them loses nothing (the next touch maps them again from the page cache). Only for a table that is
not also the output layer: a tied table is read whole at every step.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from lmpress.memory import drop_pages


def embedding_then_drop(tokens: torch.Tensor, table: torch.Tensor, mapped_at: int) -> torch.Tensor:
    """The rows of ``tokens``; then, where ``table`` still lies at ``mapped_at`` (the file mapping it was
    built on, not a copy made by a move or a cast since), its pages are dropped."""
    rows = F.embedding(tokens, table)
    if table.data_ptr() == mapped_at:
        drop_pages(mapped_at, table.numel() * table.element_size())
    return rows


# The tables built on a file mapping, by address: (bytes, the module's parameter). A compiled step looks its table
# up here rather than taking the address as an argument: an address is a constant of the graph, which made
# inductor's cache key differ in every process (SmolLM2's step recompiled for 58 s at every `generate --compile`).
_MAPPED_TABLES: dict[int, tuple[int, weakref.ref]] = {}


def _still_mapped(table: torch.Tensor) -> int | None:
    """``table``'s address where it is a registered table still lying on its file mapping, else None."""
    entry = _MAPPED_TABLES.get(table.data_ptr())
    if entry is None:
        return None
    size, parameter = entry
    held = parameter()
    if held is None or held.data_ptr() != table.data_ptr() or table.numel() * table.element_size() != size:
        return None
    return table.data_ptr()


# The same as a custom op, so that a compiled step keeps the lookup and the drop together, in this order.
# Eager code calls the function itself: a custom op's first call imports torch's compiler stack (about
# 900 modules, +150 MiB resident, in a one-off measurement), more than the table it would keep out.
@torch.library.custom_op("lmpress::mapped_embedding", mutates_args=())
def mapped_embedding(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    mapped_at = _still_mapped(table)
    return embedding_then_drop(tokens, table, -1 if mapped_at is None else mapped_at)


@mapped_embedding.register_fake
def _(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table.new_empty((*tokens.shape, table.shape[1]))


class MappedEmbedding(nn.Module):
    """``nn.Embedding`` over a table memory-mapped from a checkpoint file, keeping none of it resident."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(table, requires_grad=False)
        self.num_embeddings, self.embedding_dim = table.shape
        self.mapped_at = table.data_ptr()
        _MAPPED_TABLES[self.mapped_at] = (table.numel() * table.element_size(), weakref.ref(self.weight))
        weakref.finalize(self.weight, _MAPPED_TABLES.pop, self.mapped_at, None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return mapped_embedding(tokens, self.weight)
        return embedding_then_drop(tokens, self.weight, self.mapped_at)
