"""The layer-by-layer calibration engine every one-shot method shares (GPTQ, AWQ; later SmoothQuant, SparseGPT, Wanda).

1. The inputs of the first decoder layer are captured for every calibration
   sample (hidden states and the keyword arguments the layer receives: attention
   mask, position ids, rotary cos/sin) by running the model up to layer 0 and
   leaving it by an exception.
2. Each layer in turn is moved to the compute device and handed to the method as
   a :class:`LayerSession`. The method gathers statistics with
   :meth:`LayerSession.forward` (pre-hooks on the linears it watches; each batch
   stops as soon as every watched linear has seen its input) and writes its result
   with :meth:`LayerSession.apply`. Groups from ``anatomy.sequential`` are handled
   in dependency order, so a group's statistics come from inputs produced by
   already-quantized predecessors ("true sequential").
3. The layer's outputs are recomputed with the modified weights and become the
   next layer's inputs, written over the layer's inputs batch by batch.
   Activations between passes are kept in float16 (float32 for a batch whose
   values float16 cannot hold), each kind in one slab (``lmpress.activations``).
   A block (``anatomy.blocks``: attention, MLP) whose linears are all finished is
   computed once on every batch and its outputs replayed in the later passes of
   the layer, so each pass recomputes only what changed since the last one.
4. After each layer its state (quantized weights, changed parameters) and the
   next layer's inputs are written atomically to the stage's state directory, so
   an interrupted run resumes from the last finished layer and ends bit-identical.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from lmpress.activations import BatchStore, LayerInputs, map_tensors
from lmpress.errors import LmpressInputError
from lmpress.layer_state import LayerState
from lmpress.model import Anatomy, context_length, decoder_layers, get_anatomy, layer_linears
from lmpress.moe import set_calibrate_all
from lmpress.pages import drop_file_pages, trim_heap
from lmpress.quantize.apply import apply_quantized_weight
from lmpress.quantize.scheme import QuantizedWeight, QuantScheme
from lmpress.registry import StageContext

InputHook = Callable[[str, int, tuple, dict], None]


class _StopForward(Exception):
    """Raised from a hook to leave a forward pass once the needed inputs are seen."""


class LayerwiseMethod(Protocol):
    """A one-shot method: ``process_layer`` gathers statistics and modifies one decoder layer."""

    name: str
    warnings: list[str]

    def process_layer(self, session: LayerSession) -> None: ...


def check_finite(x: torch.Tensor, where: str) -> None:
    # One reduction decides the common case; a non-finite sum may still be an overflow of finite values.
    if torch.isfinite(x.sum(dtype=torch.float32)) or torch.isfinite(x).all():
        return
    bad = "NaN" if torch.isnan(x).any() else "inf"
    raise LmpressInputError(
        f"{bad} in the calibration activations at {where}: the model's float weights or the "
        "calibration text produce non-finite values there (check the checkpoint and dtype; float16 "
        "models overflow more easily than bfloat16/float32)"
    )


def _first_input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _move(obj: Any, device: torch.device) -> Any:
    return map_tensors(obj, lambda t: t.to(device))


@torch.no_grad()
def capture_first_layer_inputs(
    model: nn.Module, calibration: torch.Tensor, batch_size: int, device: torch.device
) -> LayerInputs:
    anatomy = get_anatomy(model)
    layer0 = decoder_layers(model)[0]
    batches = calibration.split(batch_size)
    captured = LayerInputs(BatchStore([len(b) for b in batches]), [])

    def grab(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = _first_input(args, kwargs)
        check_finite(hidden, f"the input of decoder layer 0 ({anatomy.layers}.0)")
        captured.hidden[len(captured.kwargs)] = hidden
        kept = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "past_key_values", "use_cache")}
        captured.kwargs.append(_move(kept, torch.device("cpu")))
        raise _StopForward

    pre = [model.get_submodule(name) for name in anatomy.pre_layer_modules if _has_submodule(model, name)]
    for module in pre:
        module.to(device)
    handle = layer0.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for batch in batches:
            try:
                model(batch.to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
        for module in pre:
            module.to("cpu")
    if len(captured.hidden) != len(batches):
        raise LmpressInputError(f"{model.config.model_type}: the model never reached decoder layer 0")
    return captured


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def expand_groups(anatomy: Anatomy, names: Iterable[str]) -> list[list[str]]:
    """``anatomy.sequential`` with ``*`` patterns expanded over ``names``, keeping only present linears."""
    names = list(names)
    groups, covered = [], set()
    for patterns in anatomy.sequential:
        group = [n for n in names if n not in covered and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        covered.update(group)
        if group:
            groups.append(group)
    missing = [n for n in names if n not in covered]
    if missing:
        raise LmpressInputError(
            f"the layer-wise engine cannot place linear layer(s) {', '.join(missing)} in the "
            f"{anatomy.families[0]} anatomy's sequential order; add them to ignore"
        )
    return groups


@dataclass
class LayerSession:
    """One decoder layer on the compute device, with its calibration inputs."""

    index: int
    layer: nn.Module
    prefix: str  # full module name of the layer followed by "."
    targets: dict[str, QuantScheme]  # relative linear name -> scheme, in module order
    groups: list[list[str]]  # targets in dependency order (one group when not true-sequential)
    inputs: LayerInputs
    device: torch.device
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    biases: dict[str, torch.Tensor] = field(default_factory=dict)
    model: nn.Module | None = None
    blocks: tuple[str, ...] = ()  # anatomy.blocks present in this layer
    fed_only_by: tuple[tuple[str, tuple[str, ...]], ...] = ()  # anatomy.fed_only_by present in this layer
    independent_groups: bool = True  # no linear of a group reads another's output (false when groups are merged)
    attention: str | None = None  # anatomy.attention, when present in this layer
    _packed: dict[str, nn.Module] = field(default_factory=dict)
    _replay: dict[str, BatchStore] = field(default_factory=dict)  # finished block -> its output per batch
    _fed: dict[str, BatchStore] = field(default_factory=dict)  # linear -> its input per batch

    def linear(self, name: str) -> nn.Linear:
        return self.layer.get_submodule(name)

    def batches(self, limit: int | None = None) -> Iterable[tuple[torch.Tensor, dict]]:
        dtype = next(self.layer.parameters()).dtype
        count = len(self.inputs.hidden) if limit is None else min(limit, len(self.inputs.hidden))
        for i in range(count):
            yield self.inputs.hidden[i].to(self.device, dtype), _move(self.inputs.kwargs[i], self.device)

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
        shared = _SharedInput(len(watch))

        def hook_for(name: str) -> Callable:
            def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                x = _first_input(args, kwargs)
                check_finite(x, f"the input of {self.prefix}{name} (decoder layer {self.index})")
                names = watch if shared.proven else [name]
                if current[0] == 0:
                    shared.observe(x, args, kwargs)
                for n in names:
                    on_input(n, current[0], args, kwargs)
                fired.update(names)
                seen.update(names)
                if len(fired) == len(watch):
                    raise _StopForward

            return hook

        trim_heap()  # what the previous pass and the method freed, before this pass records more
        modules = {n: self.layer.get_submodule(n) for n in watch}
        handles = [m.register_forward_pre_hook(hook_for(n), with_kwargs=True) for n, m in modules.items()]
        if skip_watched:
            for module in modules.values():
                module.forward = _zeros_like_output(module)
        set_calibrate_all(self.layer, True)
        try:
            with self._replaying(current, full_pass=limit is None, busy=watch):
                for batch_index, (hidden, kwargs) in enumerate(self.batches(limit)):
                    current[0] = batch_index
                    fired.clear()
                    try:
                        self.layer(hidden, **kwargs)
                    except _StopForward:
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
    def outputs(self) -> LayerInputs:
        """The layer's outputs on every batch with its current weights: the next layer's inputs.

        This is the layer's last pass: each batch's output is written over its
        input, so the inputs' slab carries the next layer's inputs.
        """
        trim_heap()
        current = [0]
        with self._replaying(current, full_pass=True, busy=(), record=False):
            for batch_index, (hidden, kwargs) in enumerate(self.batches()):
                current[0] = batch_index
                out = self.layer(hidden, **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                check_finite(out, f"the output of decoder layer {self.index} ({self.prefix.rstrip('.')})")
                self.inputs.hidden[batch_index] = out
        return self.inputs

    def _finished(self, block: str) -> bool:
        """Whether every target linear of ``block`` is quantized (and there is at least one)."""
        inside = [n for n in self.targets if n.startswith(block + ".")]
        return bool(inside) and all(n in self.quantized for n in inside)

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
                replace_forward(module, _replay_from(recorded, current, self.device, dtype))
                replayed.append(block + ".")
            elif record:
                self._replay[block] = recorded = BatchStore(self.inputs.hidden.rows)
                handles.append(module.register_forward_hook(_recorder(recorded, current)))
        for consumer, producers in self.fed_only_by if full_pass else ():
            if not all(p in self.quantized for p in producers):
                continue
            if consumer.startswith(tuple(replayed)):
                self._fed.pop(consumer, None)
                continue
            module = self.layer.get_submodule(consumer)
            recorded = self._fed.get(consumer)
            if recorded is not None and len(recorded) == n_batches and consumer not in busy:
                for producer in producers:
                    replace_forward(self.layer.get_submodule(producer), _zeros_like_output(self.linear(producer)))
                handles.append(module.register_forward_pre_hook(_input_from(recorded, current, self.device, dtype)))
                if self.attention and consumer.startswith(self.attention + "."):
                    contexts.enter_context(_attention_discarded(self.layer.get_submodule(self.attention)))
                block = next((b for b in self.blocks if consumer.startswith(b + ".")), None)
                if block is not None:
                    handles.extend(_shortcut_to_output(self.layer.get_submodule(block), module, replace_forward))
            elif record and (recorded is None or len(recorded) != n_batches):
                self._fed[consumer] = recorded = BatchStore(self.inputs.hidden.rows)
                # Before the calibration hooks, which may end the batch at this linear.
                handles.append(module.register_forward_pre_hook(_input_recorder(recorded, current), prepend=True))
        try:
            with contexts:
                yield
        finally:
            for h in handles:
                h.remove()
            for module in replaced:
                del module.forward

    def apply(self, name: str, qweight: QuantizedWeight) -> None:
        """Put ``qweight`` in place of linear ``name`` (relative to the layer) and record it for resume.

        Until :meth:`finish`, a plain float linear holding the quantized layer's
        dequantized weight stands in for it, so the remaining calibration passes do
        not dequantize packed weights on every call.
        """
        linear = self.linear(name)
        if linear.bias is not None:
            self.biases[name] = linear.bias.detach().cpu().clone()
        self.quantized[name] = qweight
        packed = apply_quantized_weight(self.layer, name, qweight)
        self._packed[name] = packed
        float_weight = linear.weight.data
        linear.weight.data = packed.dequantized_weight(linear.weight.dtype).to(linear.weight.device)
        _set_submodule(self.layer, name, linear)
        drop_file_pages(float_weight)

    def finish(self) -> None:
        """Put the quantized modules in place of their float stand-ins."""
        for name, packed in self._packed.items():
            _set_submodule(self.layer, name, packed)
        self._packed.clear()
        self._replay.clear()
        self._fed.clear()


class _SharedInput:
    """Watches the watched modules' inputs in a calibration pass's first batch: ``same`` while every
    one of them has read the very tensor the first one read, unmodified (its version unchanged) and
    as its only argument."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.seen = 0
        self.same = expected > 1
        self.proven = False
        self._first: tuple[torch.Tensor, int] | None = None

    def observe(self, x: torch.Tensor, args: tuple, kwargs: dict) -> None:
        self.seen += 1
        alone = len(args) + len(kwargs) == 1
        if self._first is None:
            self._first = (x, x._version)
            self.same = self.same and alone
        else:
            first, version = self._first
            self.same = self.same and alone and x is first and x._version == version

    def complete(self) -> bool:
        """Whether the first batch showed it: every watched module seen once, all reading that tensor."""
        self._first = None
        return self.same and self.seen == self.expected


_IGNORED = torch.empty(0)


def _shortcut_to_output(block: nn.Module, linear: nn.Module, replace_forward: Callable) -> list:
    """Hooks that watch ``block``'s first call: when it returns ``linear``'s output itself (alone, or
    first in a tuple of Nones), the block's forward is replaced by a call of ``linear``, whose
    pre-hook feeds it its recorded input; everything else the block computes is discarded anyway."""
    last = {}

    def remember(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        last["output"] = output

    def check(module: nn.Module, args: tuple, output: Any) -> None:
        produced = last.pop("output", None)
        for handle in handles:
            handle.remove()
        if produced is None:
            return
        if output is produced:
            replace_forward(block, lambda *args, **kwargs: linear(_IGNORED))
        elif isinstance(output, tuple) and output and output[0] is produced and all(o is None for o in output[1:]):
            rest = output[1:]
            replace_forward(block, lambda *args, **kwargs: (linear(_IGNORED), *rest))

    handles = [linear.register_forward_hook(remember), block.register_forward_hook(check)]
    return handles


DISCARDED_ATTENTION = "lmpress_discarded"


def _zeros_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """An attention kernel whose result is never read: zeros in the (batch, q_len, heads, head_dim) layout."""
    batch, heads, q_len, _ = query.shape
    return query.new_zeros(batch, q_len, heads, value.shape[-1]), None


@contextmanager
def _attention_discarded(attention: nn.Module) -> Iterator[None]:
    """Run ``attention`` (a transformers attention module) with :func:`_zeros_attention` as its kernel."""
    config = getattr(attention, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        yield
        return
    from transformers import AttentionInterface

    AttentionInterface.register(DISCARDED_ATTENTION, _zeros_attention)
    before = config._attn_implementation
    config._attn_implementation = DISCARDED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def _zeros_like_output(linear: nn.Module) -> Callable:
    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], linear.out_features)

    return forward


def _recorder(store: BatchStore, current: list[int]) -> Callable:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        store[current[0]] = output

    return hook


def _input_recorder(store: BatchStore, current: list[int]) -> Callable:
    def hook(module: nn.Module, args: tuple) -> None:
        store[current[0]] = args[0]

    return hook


def _input_from(store: BatchStore, current: list[int], device: torch.device, dtype: torch.dtype) -> Callable:
    def hook(module: nn.Module, args: tuple) -> tuple:
        return (store[current[0]].to(device, dtype), *args[1:])

    return hook


def _replay_from(store: BatchStore, current: list[int], device: torch.device, dtype: torch.dtype) -> Callable:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return map_tensors(store[current[0]], lambda t: t.to(device, dtype) if t.is_floating_point() else t.to(device))

    return forward


def _set_submodule(module: nn.Module, name: str, child: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(module.get_submodule(parent_name) if parent_name else module, attr, child)


def run_layerwise(
    model: nn.Module,
    method: LayerwiseMethod,
    scheme_for: Callable[[str], QuantScheme | None],
    ctx: StageContext,
    true_sequential: bool = True,
    batch_size: int = 4,
) -> dict:
    """Run ``method`` over every decoder layer of ``model`` (in place); returns a summary for the stage report.

    ``scheme_for(full_module_name)`` gives a linear's scheme, or None to leave it alone.
    """
    start_time = time.perf_counter()
    anatomy = get_anatomy(model)
    layers = decoder_layers(model)
    state = LayerState(ctx.state_dir, ctx.fingerprint)
    done = state.done_layers() if ctx.resume else 0
    if not ctx.resume:
        state.clear()
    calibration = ctx.calibration()
    if calibration.dim() != 2 or calibration.numel() == 0:
        raise LmpressInputError(
            f"calibration data must be (n_samples, seq_len) token ids, got {tuple(calibration.shape)}"
        )
    if calibration.shape[1] > context_length(model):
        raise LmpressInputError(
            f"calibration samples of {calibration.shape[1]} tokens are longer than the model's context "
            f"({context_length(model)}); lower data.seq_len"
        )
    device = ctx.device
    quantized = 0
    for index in range(done):
        quantized += state.restore_layer(index, layers[index])
    if done < len(layers):
        inputs = capture_first_layer_inputs(model, calibration, batch_size, device)
        if done:
            inputs = state.load_inputs(done, inputs.kwargs)

    for index in ctx.bars.track(range(done, len(layers)), f"{method.name}: layers", total=len(layers) - done):
        layer = layers[index]
        prefix = f"{anatomy.layers}.{index}."
        targets = {}
        for name in layer_linears(layer):
            scheme = scheme_for(prefix + name)
            if scheme is not None:
                targets[name] = scheme
        groups = expand_groups(anatomy, targets)
        if not true_sequential and groups:
            groups = [[n for g in groups for n in g]]
        layer.to(device)
        blocks = tuple(b for b in anatomy.blocks if _has_submodule(layer, b))
        fed_only_by = tuple((c, p) for c, p in anatomy.fed_only_by if all(_has_submodule(layer, n) for n in (c, *p)))
        attention = anatomy.attention if anatomy.attention and _has_submodule(layer, anatomy.attention) else None
        session = LayerSession(
            index, layer, prefix, targets, groups, inputs, device, model=model, blocks=blocks,
            fed_only_by=fed_only_by, independent_groups=true_sequential, attention=attention,
        )  # fmt: skip
        method.process_layer(session)
        inputs = session.outputs()
        session.finish()
        layer.to("cpu")
        quantized += len(session.quantized)
        state.save_layer(session, inputs)

    return {
        "layers": len(layers),
        "quantized_linears": quantized,
        "resumed_at_layer": done if ctx.resume else None,
        "seconds": round(time.perf_counter() - start_time, 2),
        "calibration": list(calibration.shape),
        "warnings": list(method.warnings),
    }
