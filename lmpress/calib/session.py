"""One decoder layer on the compute device with its calibration inputs: the passes methods run on it.

A method gathers statistics with :meth:`LayerSession.forward` (pre-hooks on the
linears it watches; each batch stops as soon as every watched linear has seen its
input) and declares what it modifies:

- a float weight, optionally with the mask of its pruned entries
  (:meth:`LayerSession.set_weight`; the mask stays readable to later methods of the
  same pass, which keep those entries zero);
- a quantized weight, which replaces the linear by a ``QuantizedLinear`` (an ``Fp8Linear``,
  an ``Fp4Linear``) (:meth:`LayerSession.apply`).

The engine marks each group of linears finished once every method of the pass has
processed it (:meth:`LayerSession.finish_group`). A block (``anatomy.blocks``:
attention, MLP) whose linears are all finished is computed once on every batch and
its outputs replayed in the later passes of the layer, so each pass recomputes
only what changed since the last one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lmpress.calib.activations import BatchStore, LayerInputs
from lmpress.calib.expert_ranks import expert_linear_owners
from lmpress.calib.hooks import (
    SharedInput,
    StopForward,
    attention_discarded,
    check_finite,
    first_input,
    input_from,
    input_recorder,
    move_to,
    recorder,
    replay_from,
    set_submodule,
    shortcut_to_output,
    zeros_like_output,
)
from lmpress.calib.moe import set_calibrate_all
from lmpress.calib.pages import drop_file_pages, trim_heap
from lmpress.calib.ranks import calibration_ranks
from lmpress.weights.apply import apply_quantized_weight
from lmpress.weights.float8 import Fp8Weight
from lmpress.weights.fp4 import Fp4Weight
from lmpress.weights.online_rotation import carry_input_rotation, keep_rotation_first
from lmpress.weights.scheme import QuantizedWeight

InputHook = Callable[[str, int, tuple, dict], None]
OutputHook = Callable[[int, torch.Tensor, torch.Tensor], None]


class PackedStandIn(nn.Module):
    """A linear quantized while its layer is calibrated, run from its packed module: the weight dequantized on
    each call, the very bits a float stand-in would hold (``LayerSession.apply``)."""

    def __init__(self, packed: nn.Module, linear: nn.Linear) -> None:
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_dtype = linear.weight.dtype
        self.bias = linear.bias
        carry_input_rotation(linear, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.packed.dequantized_weight(self.weight_dtype).to(x.device)
        return torch.nn.functional.linear(x, weight, self.bias)


@dataclass
class LayerSession:
    """One decoder layer on the compute device, with its calibration inputs."""

    index: int
    layer: nn.Module
    prefix: str  # full module name of the layer followed by "."
    targets: dict[str, Any]  # relative linear name -> the method's setting for it (a QuantScheme...), in module order
    groups: list[list[str]]  # targets in dependency order (one group when not true-sequential)
    inputs: LayerInputs
    device: torch.device
    # by QuantizedLinear / Fp8Linear / Fp4Linear
    quantized: dict[str, QuantizedWeight | Fp8Weight | Fp4Weight] = field(default_factory=dict)
    biases: dict[str, torch.Tensor] = field(default_factory=dict)  # of the quantized linears
    masks: dict[str, torch.Tensor] = field(default_factory=dict)  # linear -> bool mask of its pruned weights
    rewritten: set[str] = field(default_factory=set)  # linears whose float weight a method replaced
    finished: set[str] = field(default_factory=set)  # linears every method of the pass is done with
    statistics: dict[Any, Any] = field(default_factory=dict)  # shared per-group statistics (Hessians...)
    model: nn.Module | None = None
    blocks: tuple[str, ...] = ()  # anatomy.blocks present in this layer
    fed_only_by: tuple[tuple[str, tuple[str, ...]], ...] = ()  # anatomy.fed_only_by present in this layer
    independent_groups: bool = True  # no linear of a group reads another's output (false when groups are merged)
    attention: str | None = None  # anatomy.attention, when present in this layer
    ranks: int = 1  # processes sharing the calibration batches (lmpress.calib.ranks): these inputs are one share
    # the group's linears whose Hessian one rank alone holds, and that rank (MoE experts: calib.expert_ranks)
    hessian_owners: dict[str, int] = field(default_factory=dict)
    # spread: the rank that solves each MoE expert's linears and alone holds their float stand-ins
    expert_owners: dict[str, int] = field(default_factory=dict)
    _packed: dict[str, nn.Module] = field(default_factory=dict)
    _replay: dict[str, BatchStore] = field(default_factory=dict)  # finished block -> its output per batch
    _fed: dict[str, BatchStore] = field(default_factory=dict)  # linear -> its input per batch

    def __post_init__(self) -> None:
        if self.ranks > 1:
            self.expert_owners = expert_linear_owners(self.layer, self.targets, self.ranks)

    def linear(self, name: str) -> nn.Linear:
        return self.layer.get_submodule(name)

    def batches(self, limit: int | None = None) -> Iterable[tuple[torch.Tensor, dict]]:
        dtype = next(self.layer.parameters()).dtype
        count = len(self.inputs.hidden) if limit is None else min(limit, len(self.inputs.hidden))
        for i in range(count):
            yield self.inputs.hidden[i].to(self.device, dtype), move_to(self.inputs.kwargs[i], self.device)

    @torch.no_grad()
    def forward(
        self, watch: Iterable[str], on_input: InputHook, limit: int | None = None, skip_watched: bool = False
    ) -> None:
        """One pass over the calibration batches (the first ``limit`` of them, or all) calling
        ``on_input(name, batch, args, kwargs)`` before each watched submodule runs; a batch
        stops once every watched module has run.

        ``skip_watched``: the watched linears return zeros instead of computing their
        outputs, for a group whose members never read each other's outputs (one of
        ``anatomy.sequential``'s groups); when they all read one tensor in the first
        batch (q/k/v, gate/up), later batches end at the first of them.
        Mixture-of-experts blocks run every expert on every token during this pass.
        """
        watch = list(dict.fromkeys(watch))
        seen: set[str] = set()
        fired: set[str] = set()
        current = [0]  # batch index, read by the hooks
        shared = SharedInput(len(watch))

        def hook_for(name: str) -> Callable:
            def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                x = first_input(args, kwargs)
                check_finite(x, f"the input of {self.prefix}{name} (decoder layer {self.index})")
                names = watch if shared.proven else [name]
                if current[0] == 0:
                    shared.observe(x, args, kwargs)
                for n in names:
                    on_input(n, current[0], args, kwargs)
                fired.update(names)
                seen.update(names)
                if len(fired) == len(watch):
                    raise StopForward

            return hook

        trim_heap()  # what the previous pass and the method freed, before this pass records more
        modules = {n: self.layer.get_submodule(n) for n in watch}
        handles = [m.register_forward_pre_hook(hook_for(n), with_kwargs=True) for n, m in modules.items()]
        if skip_watched:
            for module in modules.values():
                module.forward = zeros_like_output(module)
        set_calibrate_all(self.layer, True)
        try:
            with self._replaying(current, full_pass=limit is None, busy=watch):
                for batch_index, (hidden, kwargs) in enumerate(self.batches(limit)):
                    current[0] = batch_index
                    fired.clear()
                    try:
                        self.layer(hidden, **kwargs)
                    except StopForward:
                        pass
                    if batch_index == 0:
                        shared.proven = skip_watched and shared.complete()
        finally:
            set_calibrate_all(self.layer, False)
            for h in handles:
                h.remove()
            if skip_watched:
                for module in modules.values():
                    del module.forward
        never = [n for n in watch if n not in seen]
        if never:
            raise RuntimeError(f"layer {self.index}: {', '.join(never)} never ran during the calibration pass")

    @torch.no_grad()
    def outputs(self, on_output: OutputHook | None = None) -> LayerInputs:
        """The layer's outputs on every batch with its current weights: the next layer's inputs.

        This is the layer's last pass: each batch's output is written over its
        input, so the inputs' slab carries the next layer's inputs.
        ``on_output(batch, input, output)`` sees each batch before that.
        """
        trim_heap()
        current = [0]
        with self._replaying(current, full_pass=True, busy=(), record=False):
            for batch_index, (hidden, kwargs) in enumerate(self.batches()):
                current[0] = batch_index
                out = self.layer(hidden, **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                check_finite(out, f"the output of decoder layer {self.index} ({self.prefix.rstrip('.')})")
                if on_output is not None:
                    on_output(batch_index, hidden, out)
                self.inputs.hidden[batch_index] = out
        return self.inputs

    def _finished(self, block: str) -> bool:
        """Whether every target linear of ``block`` is finished (and there is at least one)."""
        inside = [n for n in self.targets if n.startswith(block + ".")]
        return bool(inside) and all(n in self.finished for n in inside)

    @contextmanager
    def _replaying(
        self, current: list[int], full_pass: bool, busy: Iterable[str], record: bool = True
    ) -> Iterator[None]:
        """During a full pass: replay what finished linears computed in an earlier pass, record what they compute now.

        - a finished block's output (``blocks``): its input no longer changes either,
          since everything before it in the layer belongs to earlier groups of
          ``anatomy.sequential``;
        - the input of a linear whose producers are finished (``fed_only_by``): the
          producers then return zeros and the linear reads the recorded input; when
          that linear is the attention's output projection, the attention kernel's
          result is discarded too, so a kernel returning zeros stands in for it; when
          the linear's output is what its block returns (o_proj, down_proj), the block
          is reduced to that linear once the first batch has shown it.
        A linear's recorded input is dropped once its block's output is replayed.
        """
        busy = list(busy)
        n_batches = len(self.inputs.hidden)
        dtype = next(self.layer.parameters()).dtype
        handles, replaced, replayed = [], [], []
        contexts = ExitStack()

        def replace_forward(module: nn.Module, forward: Callable) -> None:
            module.forward = forward
            replaced.append(module)

        for block in self.blocks if full_pass else ():
            if not self._finished(block) or any(n.startswith(block + ".") for n in busy):
                continue
            module = self.layer.get_submodule(block)
            recorded = self._replay.get(block)
            if recorded is not None and len(recorded) == n_batches:
                replace_forward(module, replay_from(recorded, current, self.device, dtype))
                replayed.append(block + ".")
            elif record:
                self._replay[block] = recorded = BatchStore(self.inputs.hidden.rows, self.inputs.hidden.spill)
                handles.append(module.register_forward_hook(recorder(recorded, current)))
        for consumer, producers in self.fed_only_by if full_pass else ():
            if not all(p in self.finished for p in producers):
                continue
            if consumer.startswith(tuple(replayed)):
                self._fed.pop(consumer, None)
                continue
            module = self.layer.get_submodule(consumer)
            recorded = self._fed.get(consumer)
            if recorded is not None and len(recorded) == n_batches and consumer not in busy:
                for producer in producers:
                    replace_forward(self.layer.get_submodule(producer), zeros_like_output(self.linear(producer)))
                handles.append(module.register_forward_pre_hook(input_from(recorded, current, self.device, dtype)))
                if self.attention and consumer.startswith(self.attention + "."):
                    contexts.enter_context(attention_discarded(self.layer.get_submodule(self.attention)))
                block = next((b for b in self.blocks if consumer.startswith(b + ".")), None)
                if block is not None:
                    handles.extend(shortcut_to_output(self.layer.get_submodule(block), module, replace_forward))
            elif record and (recorded is None or len(recorded) != n_batches):
                self._fed[consumer] = recorded = BatchStore(self.inputs.hidden.rows, self.inputs.hidden.spill)
                # Before the calibration hooks, which may end the batch at this linear.
                handles.append(module.register_forward_pre_hook(input_recorder(recorded, current), prepend=True))
                keep_rotation_first(module)  # R4: the linear's input is the rotated one
        try:
            with contexts:
                yield
        finally:
            for h in handles:
                h.remove()
            for module in replaced:
                del module.forward

    def apply(self, name: str, qweight: QuantizedWeight | Fp8Weight | Fp4Weight) -> None:
        """Put ``qweight`` in place of linear ``name`` (relative to the layer) and record it for resume.

        Until :meth:`finish`, a plain float linear holding the quantized layer's
        dequantized weight stands in for it, so the remaining calibration passes do
        not dequantize packed weights on every call. A MoE expert's linear solved in another process
        (``expert_owners``) is run from its packed codes instead, dequantized on each call to the same bits: each
        process holds the float stand-ins of its own experts alone.
        """
        linear = self.linear(name)
        if linear.bias is not None:
            self.biases[name] = linear.bias.detach().cpu().clone()
        self.quantized[name] = qweight
        packed = apply_quantized_weight(self.layer, name, qweight)
        self._packed[name] = packed
        float_weight = linear.weight.data
        rank = calibration_ranks()[0]
        if self.expert_owners.get(name, rank) != rank:
            set_submodule(self.layer, name, PackedStandIn(packed, linear))
        else:
            linear.weight.data = packed.dequantized_weight(linear.weight.dtype).to(linear.weight.device)
            set_submodule(self.layer, name, linear)
        drop_file_pages(float_weight)

    def set_weight(self, name: str, weight: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Write float ``weight`` into linear ``name`` in place; ``mask`` (True = pruned) marks its pruned entries.

        The mask stays in :attr:`masks` for the rest of the layer so that a later
        method of the same pass (quantization) keeps those entries zero.
        """
        linear = self.linear(name)
        linear.weight.data.copy_(weight.to(linear.weight.dtype))
        self.rewritten.add(name)
        if mask is not None:
            self.masks[name] = mask

    def finish_group(self, names: Iterable[str]) -> None:
        """Every method of the pass is done with linears ``names``: their outputs no longer change."""
        self.finished.update(names)
        self.statistics.clear()
        self.hessian_owners.clear()

    def finish(self) -> None:
        """Put the quantized modules in place of their float stand-ins."""
        for name, packed in self._packed.items():
            set_submodule(self.layer, name, packed)
        self._packed.clear()
        self._replay.clear()
        self._fed.clear()
        self.masks.clear()
        self.statistics.clear()
