"""``lmpress inspect``'s tables: ``inspect.inspect_artifact``'s result as a summary and one row per layer.

Readable at any width (a pipe or a CI log is 80 columns): a column whose value every layer shares moves into the
table's foot, and where the full layer names and the columns left still do not fit, the names are listed under
their block (``model.layers.0`` once, then ``self_attn.q_proj`` and the rest) rather than cut.
"""

from __future__ import annotations

import io
import re
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from lmpress.export.inspect import natural_key


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


# Zero weights are sparsity only where a pruning method made them; a 4-bit grid rounds many small weights to 0.
SUMMARY_LABELS = {"sparsity": "zero weights", "tensors": "tensors", "group_size": "group / block size"}


def _summary_table(info: dict[str, Any]) -> Table:
    table = Table(title=f"{info['path']}", show_header=False)
    table.add_column("key", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    keys = (
        "format",
        "checkpoint_format",
        "version",
        "ct_format",
        "architecture",
        "bits",
        "group_size",
        "sym",
        "activations",
        "act_order",
        "fp4",
        "quantized_layers",
        "tensors",
        "parameters",
        "sparsity",
        "dtypes",
        "tensor_types",
        "scale_encoding",
        "kv_cache",
        "online_rotations",
        "vllm",
    )
    for key in keys:
        if key in info and info[key] is not None:
            label = SUMMARY_LABELS.get(key, key)
            table.add_row(label, f"{info[key]:.1%}" if key == "sparsity" else str(info[key]))
    for key, value in info.get("metadata", {}).items():
        table.add_row(key, str(value))
    table.add_row("size on disk", _mb(info["size_bytes"]))
    if info.get("quantized_weights"):
        table.add_row("quantized tensors", _mb(info["quantized_bytes"]))
        table.add_row("other tensors", _mb(info["other_bytes"]))
        table.add_row("bits per quantized weight", f"{8 * info['quantized_bytes'] / info['quantized_weights']:.3f}")
    return table


# Columns a layer table may move to a line below it when every row holds the same value; shapes, sizes and zero
# counts are each layer's own.
SHARED_COLUMNS = ("bits", "group", "sym", "act-order", "activations", "fp4", "scales", "type", "block", "bits/weight")
BLOCK_NAME = re.compile(r"^(.*\.\d+)\.(.+)$")  # "model.layers.0" + "self_attn.q_proj"


def _layer_cells(r: dict[str, Any], activations: bool, fp4: bool) -> dict[str, str]:
    cells = {
        "shape": "x".join(str(v) for v in r["shape"]),
        "bits": str(r["bits"]),
        "group": "channel" if r["group_size"] == -1 else str(r["group_size"]),
        "sym": "yes" if r["sym"] else "no",
        "act-order": "yes" if r["act_order"] else "no",
    }
    if activations:
        cells["activations"] = _activation_text(r["activations"])
    if fp4:
        cells |= {"fp4": r.get("fp4", "int").upper(), "scales": r.get("scale_encoding", "")}
    return cells | {
        "size": f"{r['bytes'] / 1e3:.1f} kB",
        "bits/weight": f"{r['bits_per_weight']:.3f}",
        "zeros": _sparsity_text(r),
    }


def _layer_table(rows: list[dict[str, Any]], width: int) -> Table:
    """One row per quantized layer; the activations column only when some layer quantizes its activations, the
    FP4 columns (grid, block-scale encoding) only when some layer is FP4."""
    activations = any(r.get("activations", "float") != "float" for r in rows)
    fp4 = any("fp4" in r for r in rows)
    named = [(r["name"], _layer_cells(r, activations, fp4)) for r in rows]
    return _fitted_table("quantized layers", "layer", named, width)


def _gguf_table(rows: list[dict[str, Any]], width: int) -> Table:
    named = [
        (
            r["name"],
            {
                "type": r["type"],
                "shape": "x".join(str(v) for v in r["shape"]),
                "block": str(r["block_size"]),
                "size": f"{r['bytes'] / 1e3:.1f} kB",
                "bits/weight": f"{r['bits_per_weight']:.3f}",
            },
        )
        for r in rows
    ]
    return _fitted_table("tensors", "tensor", named, width)


def _sparsity_table(rows: list[dict[str, Any]], width: int) -> Table:
    named = [(r["name"], {"shape": "x".join(str(v) for v in r["shape"]), "sparsity": _sparsity_text(r)}) for r in rows]
    return _fitted_table("sparsity per layer", "layer", named, width)


def _fitted_table(title: str, name_column: str, named: list[tuple[str, dict[str, str]]], width: int) -> Group:
    """Rows in natural order, full names where they fit in ``width`` and under their block where they do not; what
    every row shares on a line below (the console's width, not the table's)."""
    table, shared = _fitted_rows(title, name_column, named, width)
    return Group(table, Text(shared)) if shared else Group(table)


def _fitted_rows(
    title: str, name_column: str, named: list[tuple[str, dict[str, str]]], width: int
) -> tuple[Table, str]:
    named = sorted(named, key=lambda item: natural_key(item[0]))
    columns = list(named[0][1]) if named else []
    shared = {c: named[0][1][c] for c in columns if c in SHARED_COLUMNS and len({cells[c] for _, cells in named}) == 1}
    if len(named) < 2:
        shared = {}
    kept = [c for c in columns if c not in shared]
    note = "every row: " + ", ".join(f"{c} {v}" for c, v in shared.items()) if shared else ""
    table = _table(title, name_column, kept)
    for name, cells in named:
        table.add_row(name, *(cells[c] for c in kept))
    if _minimum_width(table) <= width:
        return table, note
    table = _sectioned_table(title, name_column, kept, named, fold=False)
    if _minimum_width(table) <= width:
        return table, note
    return _sectioned_table(title, name_column, kept, named, fold=True), note  # values wrap rather than end in …


def _sectioned_table(
    title: str, name_column: str, kept: list[str], named: list[tuple[str, dict[str, str]]], fold: bool
) -> Table:
    table = _table(title, f"{name_column} (under its block)", kept, fold)
    block = None
    for name, cells in named:
        match = BLOCK_NAME.match(name)
        if match and match.group(1) != block:
            table.add_row(match.group(1), *("" for _ in kept), style="bold")
        block = match.group(1) if match else None
        table.add_row(f"  {match.group(2)}" if match else name, *(cells[c] for c in kept))
    return table


def _table(title: str, name_column: str, columns: list[str], fold: bool = False) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column(name_column, no_wrap=True)
    for column in columns:
        table.add_column(column, justify="right", no_wrap=not fold, overflow="fold")
    return table


def _minimum_width(table: Table) -> int:
    """The columns ``table`` takes laid out unconstrained (its names and values never wrap): what it needs whole."""
    buffer = io.StringIO()
    Console(width=10_000, file=buffer, color_system=None).print(table)
    return max(len(line.rstrip()) for line in buffer.getvalue().splitlines())


def _activation_text(activations: str) -> str:
    if activations == "fp4":
        return "fp4 per-block"
    return "float" if activations == "float" else f"{activations} per-token"


def _sparsity_text(row: dict[str, Any]) -> str:
    return f"{row['sparsity']:.1%}" + (f" ({row['pattern']})" if row.get("pattern") else "")


def render_inspect(info: dict[str, Any], width: int = 120) -> Group:
    """Rich tables for ``inspect_artifact``'s result, laid out for a console ``width`` columns wide: a summary, then
    one row per quantized layer."""
    parts: list[Any] = []
    for artifact in info["artifacts"] if info["format"] == "run" else [info]:
        parts.append(_summary_table(artifact))
        if artifact.get("layers"):
            parts.append(_layer_table(artifact["layers"], width))
        if artifact.get("gguf_tensors"):
            parts.append(_gguf_table(artifact["gguf_tensors"], width))
        if artifact.get("sparse_layers"):
            parts.append(_sparsity_table(artifact["sparse_layers"], width))
    return Group(*parts)


def render_inspect_text(info: dict[str, Any], width: int = 120) -> str:
    """``render_inspect`` as plain text."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None).print(render_inspect(info, width))
    return buffer.getvalue()
