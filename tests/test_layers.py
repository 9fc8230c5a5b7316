"""lmpress's import arrows run one way: every module imports only from its own unit or the units below it,
and no two files import each other, directly or through others. Imports inside functions count too: a lazy
import is still an arrow.

The layer order, lowest first (docs/architecture.md#layers explains each). A unit is a top-level module or a
subpackage of ``lmpress``; adding one means adding it here, at the height of what it imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lmpress

LAYER_ORDER = [
    "errors",
    "progress",
    "memory",  # the host's memory: resident size, peaks, glibc's heap
    "placement",  # devices; handing freed memory back uses memory's
    "distributed",
    "cache",
    "texts",
    "data",
    "registry",
    "weights",  # quantization value types: schemes, packed weights, QuantizedLinear, FP8 and int8 layers
    "checkpoint_files",  # reading a checkpoint's files (config, safetensors, index), for export and runtime
    "anatomy",  # where an architecture keeps its layers
    "metrics",  # token NLL and exact KLD, for evals, export checks, pruning and distillation
    "calib",
    "quantize",
    "prune",
    "export",
    "expert_checkpoint",  # a MoE checkpoint's experts as per-expert linears mapped from its files
    "loader",  # a model from a hub id, a directory, a GGUF file or an export
    "runtime",
    "evals",
    "distill",
    "recipe",
    "memory_plan",
    "pipeline",
    "api",
    "cli",
    "__main__",  # python -m lmpress: the command
]
PACKAGE = Path(lmpress.__file__).parent


def module_name(file: Path, root: Path) -> str:
    parts = list(file.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(file: Path, root: Path) -> set[str]:
    """Every ``lmpress`` module ``file`` imports, at any depth of the file; ``from pkg import mod`` names the
    submodule where ``mod`` is one (not ``pkg``'s ``__init__``, which every import of a submodule runs)."""
    name = module_name(file, root)
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                candidate = root.parent / Path(*f"{target}.{alias.name}".split("."))
                if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
                    found.add(f"{target}.{alias.name}")
                else:  # a name defined in ``target`` itself
                    found.add(target)
    return {m for m in found if m.split(".")[0] == root.name and m != root.name}


def import_graph(root: Path) -> dict[str, set[str]]:
    return {module_name(f, root): imported_modules(f, root) for f in sorted(root.rglob("*.py"))}


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]], order: list[str]) -> list[str]:
    """``importer -> imported`` for every import of a unit above the importer's; a unit missing from ``order``
    is reported as such."""
    rank = {name: i for i, name in enumerate(order)}
    wrong = []
    for module, targets in sorted(graph.items()):
        if unit(module) == module.split(".")[0]:  # the package's own __init__: names resolved lazily
            continue
        if unit(module) not in rank:
            wrong.append(f"{module}: unit {unit(module)!r} is not in the layer order")
            continue
        for target in sorted(targets):
            if unit(target) not in rank:
                wrong.append(f"{module} -> {target}: unit {unit(target)!r} is not in the layer order")
            elif rank[unit(target)] > rank[unit(module)]:
                wrong.append(f"{module} -> {target}")
    return wrong


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_every_unit_of_the_package_is_in_the_layer_order():
    units = {unit(module_name(f, PACKAGE)) for f in PACKAGE.rglob("*.py")} - {PACKAGE.name}
    assert sorted(units - set(LAYER_ORDER)) == []
    assert sorted(set(LAYER_ORDER) - units) == []


def test_no_module_imports_a_unit_above_its_own():
    assert upward_imports(import_graph(PACKAGE), LAYER_ORDER) == []


def test_no_two_modules_import_each_other():
    assert import_cycles(import_graph(PACKAGE)) == []


def test_module_names_do_not_collide_across_subpackages():
    """A module's file name says what it is: ``model.py`` beside ``runtime/model.py`` was two things."""
    paths: dict[str, list[str]] = {}
    for f in PACKAGE.rglob("*.py"):
        if f.name != "__init__.py":
            paths.setdefault(f.stem, []).append(str(f.relative_to(PACKAGE)))
    allowed = {  # a method, its export format and its kernel share the method's name on purpose
        "gptq": ["export/gptq.py", "quantize/gptq.py"],
        "awq": ["export/awq.py", "quantize/awq.py"],
        "bnb": ["export/bnb.py", "quantize/bnb.py"],
        "fp8": ["quantize/fp8.py", "runtime/kernels/fp8.py"],
        "targets": ["prune/targets.py", "quantize/targets.py"],  # each family's config of the layers it targets
    }
    colliding = {stem: sorted(p) for stem, p in paths.items() if len(p) > 1 and sorted(p) != allowed.get(stem)}
    assert colliding == {}


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root / "pkg"


@pytest.mark.parametrize(
    "statement",
    [
        "from pkg.top import run\n",
        "import pkg.top.run\n",
        "def later():\n    from pkg.top import run\n",  # a lazy import is an arrow too
        "from ..top import run\n",
    ],
)
def test_the_check_finds_an_import_of_a_higher_unit(tmp_path, statement):
    package = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/values.py": statement,
            "pkg/top/__init__.py": "",
            "pkg/top/run.py": "from pkg.low.values import *\n",
        },
    )
    graph = import_graph(package)
    assert "pkg.low.values -> pkg.top.run" in upward_imports(graph, ["low", "top"])
    assert import_cycles(graph) == [["pkg.low.values", "pkg.top.run"]]
    (package / "low" / "values.py").write_text("VALUE = 1\n")
    assert upward_imports(import_graph(package), ["low", "top"]) == []
    assert import_cycles(import_graph(package)) == []
