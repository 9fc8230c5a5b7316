"""A ``torch.compile``'d step's graph called without dynamo's work at each call.

Each call of a dynamo-compiled function reads every graph input again from where it came from (a decode step of
SmolLM2's: ~490 inputs, ~420 of them the model's parameters and buffers reached through module attributes) and
looks its graph up in the code object's cache before it runs the graph. On 2 CPU threads that is ~0.5 ms of a
~5 ms W4 step (py-spy over the compiled decode loop, Zen 4 EPYC). The model's inputs never change between calls,
and a cache's keep their shapes while the cache lives, so after one call through dynamo (which checks its guards
and compiles where it must) ``DirectCalls`` calls the same graph directly: the model's inputs as dynamo passed
them, the rest read anew at each call by one generated function.

The contract a step keeps for that (``DirectCalls``' callers do): no Python side effects (only its graph's work,
in-place writes to the cache's tensors included), and every input that may change between calls of one binding
among the names not held fixed. The binding is made again whenever the anchor (a tensor whose life is the
cache's) or the signature (the Python values and shapes dynamo specialized on) changes.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

_ROOT = re.compile(r"L\['(\w+)'\]")
_recording = threading.local()


class RecordedGraph:
    """A compiled graph as dynamo calls it, which tells ``recording`` the inputs and outputs of each call."""

    def __init__(self, fn: Callable[..., Any], sources: list[str]) -> None:
        self.fn, self.sources = fn, sources

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        calls = getattr(_recording, "calls", None)
        if calls is not None:
            calls.append((self, args, out))
        return out


class RecordingBackend:
    """A ``torch.compile`` backend: Inductor with ``options`` (its config patches), each graph a ``RecordedGraph``
    that knows where dynamo reads each of its inputs (the placeholders' sources, e.g. ``L['k'][3]``)."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> RecordedGraph:
        from torch._inductor.compile_fx import compile_fx

        sources = [node.meta["grapharg"].source.name for node in gm.graph.find_nodes(op="placeholder")]
        return RecordedGraph(compile_fx(gm, example_inputs, config_patches=self.options), sources)


@contextmanager
def recording():
    """The ``RecordedGraph`` calls made inside: a list of ``(graph, inputs, outputs)``."""
    calls: list = []
    _recording.calls = calls
    try:
        yield calls
    finally:
        _recording.calls = None


@dataclass
class Binding:
    """One graph bound to the inputs that stay: ``inputs(named, fixed)`` builds its whole input list."""

    graph: RecordedGraph
    inputs: Callable[[dict[str, Any], tuple], tuple]
    fixed: tuple
    output: int | tuple[int, ...]  # which graph output the step returns (a tuple of them: a tuple of those)
    anchor: weakref.ref

    def __call__(self, named: dict[str, Any]) -> Any:
        out = self.graph.fn(*self.inputs(named, self.fixed))
        return out[self.output] if isinstance(self.output, int) else tuple(out[i] for i in self.output)


def bind(
    graph: RecordedGraph,
    inputs: tuple,
    outputs: Sequence[Any],
    returned: Any,
    named: dict[str, Any],
    fixed: frozenset[str],
    anchor: torch.Tensor,
) -> Binding | None:
    """The binding of ``graph`` as dynamo just called it (``inputs`` -> ``outputs``, the step ``returned``
    what it did, ``named`` its arguments), or None where a direct call could not give the same: an input read
    from outside the arguments, a name that does not give back the input dynamo read, or a result that is not
    the graph's own outputs."""
    roots = [_ROOT.match(name) for name in graph.sources]
    if any(root is None or root.group(1) not in named for root in roots):
        return None
    held = [i for i, root in enumerate(roots) if root.group(1) in fixed]
    place = {i: n for n, i in enumerate(held)}
    slots = [f"F[{place[i]}]" if i in place else source for i, source in enumerate(graph.sources)]
    # names read each call are evaluated on the arguments (``L``), the held ones index a tuple (``F``)
    code = "lambda L, F: (" + "".join(f"{slot}, " for slot in slots) + ")"
    make_inputs = eval(code, {"__builtins__": {}})  # noqa: S307 - sources dynamo wrote, e.g. L['k'][3].size()[2]
    fixed_inputs = tuple(inputs[i] for i in held)
    try:
        again = make_inputs(named, fixed_inputs)
    except Exception:  # noqa: BLE001 - a source only dynamo can read: leave the step to it
        return None
    if len(again) != len(inputs) or not all(_same(a, b) for a, b in zip(again, inputs, strict=True)):
        return None
    output = _output_index(outputs, returned)
    if output is None:
        return None
    return Binding(graph, make_inputs, fixed_inputs, output, weakref.ref(anchor))


def _same(a: Any, b: Any) -> bool:
    return a is b if isinstance(b, torch.Tensor) else type(a) is type(b) and a == b


def _output_index(outputs: Sequence[Any], returned: Any) -> int | tuple[int, ...] | None:
    def index(value: Any) -> int | None:
        return next((i for i, out in enumerate(outputs) if out is value), None)

    if isinstance(returned, torch.Tensor):
        return index(returned)
    if isinstance(returned, tuple) and returned and all(isinstance(r, torch.Tensor) for r in returned):
        found = tuple(index(r) for r in returned)
        return None if None in found else found
    return None


class DirectCalls:
    """``compiled`` called through dynamo once per anchor and signature, then its graph directly (``Binding``, one
    kept per signature). ``params`` are the step's argument names in order; inputs read from those in ``fixed``
    are held from the call through dynamo. A step compiled by another backend than a ``RecordingBackend``, or
    not compiled, records no graph: each call is ``compiled``'s own."""

    def __init__(self, compiled: Callable[..., Any], params: Sequence[str], fixed: Sequence[str]) -> None:
        self.compiled, self.params, self.fixed = compiled, tuple(params), frozenset(fixed)
        self.bindings: dict[Hashable, Binding] = {}
        self.direct = 0  # calls made by a binding (tests: the direct path was taken)

    def __call__(self, anchor: torch.Tensor, signature: Hashable, *args: Any) -> Any:
        named = dict(zip(self.params, args, strict=True))
        binding = self.bindings.get(signature)
        if binding is not None and binding.anchor() is anchor:
            self.direct += 1
            return binding(named)
        with recording() as calls:
            returned = self.compiled(*args)
        self.bindings.pop(signature, None)
        if len(calls) == 1:
            graph, inputs, outputs = calls[0]
            binding = bind(graph, inputs, outputs, returned, named, self.fixed, anchor)
            if binding is not None:
                self.bindings[signature] = binding
        return returned
