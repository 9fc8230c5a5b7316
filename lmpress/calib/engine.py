"""The layer-by-layer calibration engine every one-shot method shares (GPTQ, AWQ, SparseGPT, Wanda...).

1. The inputs of the first decoder layer are captured for every calibration
   sample (hidden states and the keyword arguments the layer receives: attention
   mask, position ids, rotary cos/sin) by running the model up to layer 0 and
   leaving it by an exception.
2. Each layer in turn is moved to the compute device and handed to the pass's
   methods as a :class:`~lmpress.calib.session.LayerSession`: first every method's
   :meth:`CalibrationMethod.prepare_layer` (whole-layer changes such as AWQ's
   scales), then, group by group of ``anatomy.sequential`` in dependency order,
   every method's :meth:`CalibrationMethod.process_group` (so a group's statistics
   come from inputs produced by already-modified predecessors, "true sequential",
   and several methods, such as SparseGPT then GPTQ, share one group's Hessian).
3. The layer's outputs are recomputed with the modified weights and become the
   next layer's inputs, written over the layer's inputs batch by batch.
   Activations between passes are kept in float16 (float32 for a batch whose
   values float16 cannot hold), each kind in one slab (``calib.activations``).
4. After each layer its state (quantized weights, changed parameters) and the
   next layer's inputs are written atomically to the stage's state directory
   (``calib.state``), so an interrupted run resumes from the last finished layer
   and ends bit-identical; the layer's packed weights are then read from that file
   as a memory mapping instead of held in RAM.
"""

from __future__ import annotations

import fnmatch
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lmpress.anatomy import Anatomy, context_length, decoder_layers, get_anatomy, layer_linears
from lmpress.calib.activations import BatchStore, LayerInputs, Spill
from lmpress.calib.compute_dtype import restore_layer_dtype, upcast_layer, widens_to_float32
from lmpress.calib.hooks import StopForward, check_finite, first_input, has_submodule, move_to
from lmpress.calib.moe import unfuse_experts
from lmpress.calib.ranks import calibration_ranks, min_across_ranks, rank_batch_rows, rank_batches, rank_samples
from lmpress.calib.resume import SavedStates
from lmpress.calib.session import LayerSession
from lmpress.calib.state import LayerState
from lmpress.errors import LmpressInputError
from lmpress.memory import large_frees_unmapped
from lmpress.placement import naming_out_of_memory
from lmpress.registry import StageContext


class CalibrationMethod:
    """A one-shot method run by the engine; override what it needs (every hook defaults to nothing)."""

    name: str = "method"
    # everything it gathers goes through lmpress.calib.statistics' accumulators, which sum across ranks: a pass of
    # such methods spreads its batches over launched processes (lmpress.calib.ranks)
    reduces_across_ranks: bool = False
    # it steps through the batches one at a time (learned rounding): a spread pass of such methods shares each
    # batch's rows out, not whole batches (lmpress.calib.ranks)
    spreads_rows: bool = False

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def prepare_layer(self, session: LayerSession) -> None:
        """Before any group of the layer: statistics and changes over the whole layer (AWQ's scales)."""

    def process_group(self, session: LayerSession, group: list[str]) -> None:
        """Gather statistics for linears ``group`` and modify them (``session.apply`` / ``set_weight``)."""

    def finish_layer(self, session: LayerSession) -> None:
        """After every group of the layer, before its outputs are recomputed."""

    def on_output(self, session: LayerSession, batch: int, inputs: torch.Tensor, outputs: torch.Tensor) -> None:
        """Each batch's layer input and output in the layer's last pass (block-influence statistics)."""

    def carried(self) -> dict[str, torch.Tensor]:
        """Tensors the method carries from a layer to the next; saved with the next layer's inputs (resume)."""
        return {}

    def restore_carried(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take back, on resume, what :meth:`carried` returned after the last finished layer."""


# Within a pass, each layer's large transient buffers (Hessians, float copies of a weight) are mapped on their own
# and go back to the OS when freed, not kept as heap between long-lived tensors. The smaller ones that every
# batch's forward allocates come from the heap and are reused: mapped on their own (from 1 MiB, the setting
# before), each came back as fresh pages, and gptq-w4.yaml's stage took 265-300 thousand page faults a second, 31%
# of its CPU time in the kernel. A trade: that stage 281-315 s -> 199 s, the Llama-3.2-1B shape of bench/scale.py
# 14.7 -> 12.7-13.4 s a layer but peak 1.33 -> 1.51-1.55 GiB (2-vCPU Xeon, 2026-12-07; docs/scale.md).
MAPPED_FROM_BYTES = 16 << 20
HEAP_KEPT_BYTES = 64 << 20  # freed at the heap's top and kept for the next batch rather than handed back at each free


def layer_kinds(model: nn.Module) -> list[str] | None:
    """Each decoder layer's type (``config.layer_types``) where the layers receive different masks or rotary
    embeddings by type (sliding-window layers, Gemma 3's local and global layers); None where all are alike."""
    kinds = getattr(model.config, "layer_types", None)
    if not kinds or len(set(kinds)) < 2 or len(kinds) != len(decoder_layers(model)):
        return None
    return list(kinds)


@torch.no_grad()
def capture_first_layer_inputs(
    model: nn.Module, batches: Sequence[torch.Tensor], device: torch.device, spill: Spill | None = None
) -> LayerInputs:
    """The first decoder layer's inputs for every batch, and, where layer types differ (:func:`layer_kinds`),
    the keyword arguments the first layer of each type receives (the layers before it pass their input through
    while these are captured: masks and rotary embeddings do not depend on the hidden states)."""
    anatomy = get_anatomy(model)
    layers = decoder_layers(model)
    kinds = layer_kinds(model)
    first_of = {} if kinds is None else {kind: kinds.index(kind) for kind in dict.fromkeys(kinds)}
    captured = LayerInputs(BatchStore([len(b) for b in batches], spill), [], {kind: [] for kind in first_of})
    last = max(first_of.values(), default=0)

    def grab_for(index: int) -> Callable:
        def grab(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = first_input(args, kwargs)
            kept = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "past_key_values", "use_cache")}
            kept = move_to(kept, torch.device("cpu"))
            if index == 0:
                check_finite(hidden, f"the input of decoder layer 0 ({anatomy.layers}.0)")
                captured.hidden[len(captured.kwargs)] = hidden
                captured.kwargs.append(kept)
            for kind, first in first_of.items():
                if first == index:
                    captured.by_kind[kind].append(kept)
            if index == last:
                raise StopForward

        return grab

    pre = [model.get_submodule(name) for name in anatomy.pre_layer_modules if has_submodule(model, name)]
    for module in pre:
        module.to(device)
    handles = [layers[i].register_forward_pre_hook(grab_for(i), with_kwargs=True) for i in {0, *first_of.values()}]
    for layer in layers[:last]:
        layer.forward = lambda hidden_states, *args, **kwargs: hidden_states
    try:
        for batch in batches:
            try:
                model(batch.to(device), use_cache=False)
            except StopForward:
                pass
    finally:
        for handle in handles:
            handle.remove()
        for layer in layers[:last]:
            del layer.forward
        for module in pre:
            module.to("cpu")
    if len(captured.hidden) != len(batches):
        raise LmpressInputError(f"{model.config.model_type}: the model never reached decoder layer 0")
    return captured


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


def process_layer(session: LayerSession, methods: Sequence[CalibrationMethod]) -> None:
    """Every method's whole-layer step, then group by group every method's group step."""
    for method in methods:
        method.prepare_layer(session)
    for group in session.groups:
        for method in methods:
            method.process_group(session, group)
        session.finish_group(group)
    for method in methods:
        method.finish_layer(session)


def _output_observer(session: LayerSession, methods: Sequence[CalibrationMethod]) -> Callable | None:
    """The ``on_output`` hooks of the methods that have one, as one callback (None when none has)."""
    observers = [m for m in methods if type(m).on_output is not CalibrationMethod.on_output]
    if not observers:
        return None

    def observe(batch: int, inputs: torch.Tensor, outputs: torch.Tensor) -> None:
        for method in observers:
            method.on_output(session, batch, inputs, outputs)

    return observe


def activation_spill(ctx: StageContext, model: nn.Module, calibration: torch.Size) -> Spill | None:
    """Where this process's calibration activations beyond ``data.activations_ram_gb`` go (None: all in RAM),
    its directory's room checked before any work: at most the layer inputs, one block's outputs and the widest
    linear's inputs are held at once."""
    if ctx.activations_ram_bytes is None:
        return None
    spill = Spill(ctx.spill_dir or ctx.state_dir / "spill", ctx.activations_ram_bytes)
    widest = max(linear.in_features for layer in decoder_layers(model) for linear in layer_linears(layer).values())
    spill.check_room(calibration.numel() * (2 * model.config.hidden_size + widest) * 2)
    return spill


def run_calibration(
    model: nn.Module,
    methods: Sequence[CalibrationMethod],
    target_for: Callable[[str], Any],
    ctx: StageContext,
    true_sequential: bool = True,
    batch_size: int = 4,
) -> dict:
    """Run ``methods`` in one pass over every decoder layer of ``model`` (in place); returns a summary.

    ``target_for(full_module_name)`` gives a linear's setting (its quantization
    scheme, its sparsity...), or None to leave it alone.
    """
    start_time = time.perf_counter()
    anatomy = get_anatomy(model)
    layers = decoder_layers(model)
    rank, world = calibration_ranks()
    state = LayerState(ctx.state_dir, ctx.fingerprint, world)
    saved = SavedStates.find(state, ctx.shared_state_dir or ctx.state_dir, rank, world) if ctx.resume else None
    done = saved.done_layers(state) if saved else 0
    earlier = state.seconds_spent() if done else 0.0  # the stage's time in the runs before this one
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
    quantized = rewritten = 0
    name = "+".join(m.name for m in methods)
    by_rows = all(m.spreads_rows for m in methods)
    spreads = all(m.reduces_across_ranks for m in methods) and (by_rows or not any(m.spreads_rows for m in methods))
    ranks = world if world > 1 and spreads else 1
    shape = list(calibration.shape)
    n_batches = math.ceil(len(calibration) / batch_size)
    if ranks > 1 and by_rows:
        batches = rank_batch_rows(calibration, batch_size, rank, world)
    elif ranks > 1:
        batches = list(rank_samples(calibration, batch_size, rank, world).split(batch_size))
    else:
        batches = list(calibration.split(batch_size))
    if world > 1:  # every rank restarts at the first layer some rank had not finished
        done = min_across_ranks(done)
    if saved is not None:
        saved.take_finished_layers(state, done)
    for index in range(done):
        quantized += state.restore_layer(index, layers[index])
    spill = activation_spill(ctx, model, torch.Size([sum(len(b) for b in batches), shape[1]]))
    if done < len(layers):
        inputs = capture_first_layer_inputs(model, batches, device, spill)
        if done:
            by_kind = inputs.by_kind
            mine = rank_batches(n_batches, rank, world) if ranks > 1 and not by_rows else range(n_batches)
            if by_rows and saved.regrouped:  # each old process's part of every batch, cut anew
                inputs, carried = saved.load_rows(done, n_batches, inputs.kwargs, spill)
            else:
                inputs, carried = saved.load_inputs(done, n_batches, mine, inputs.kwargs, spill)
            inputs.by_kind = by_kind
            if world > 1:  # every process has read the saved inputs before any saves over them
                min_across_ranks(0)
            for method in methods:
                prefix = f"{method.name}."
                method.restore_carried({k.removeprefix(prefix): v for k, v in carried.items() if k.startswith(prefix)})

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    widen = widens_to_float32(dtype, device)
    if widen and done < len(layers):
        kind = str(dtype).removeprefix("torch.")
        ctx.bars.log(f"{name}: each layer computes in float32 while calibrated (this CPU has no {kind} matrix unit)")
    with large_frees_unmapped(MAPPED_FROM_BYTES, keep_free=HEAP_KEPT_BYTES):
        kinds = layer_kinds(model)
        for index in ctx.bars.track(range(done, len(layers)), f"{name}: layers", total=len(layers) - done):
            layer = layers[index]
            if kinds is not None:
                inputs.kwargs = inputs.by_kind[kinds[index]]
            prefix = f"{anatomy.layers}.{index}."
            targets = {}
            for linear in layer_linears(layer):
                target = target_for(prefix + linear)
                if target is not None:
                    targets[linear] = target
            groups = expand_groups(anatomy, targets)
            if not true_sequential and groups:
                groups = [[n for g in groups for n in g]]
            with naming_out_of_memory(f"layer {index} ({prefix.rstrip('.')})", device):
                layer.to(device)
                originals = upcast_layer(layer, dtype) if widen else {}
                blocks = tuple(b for b in anatomy.blocks if has_submodule(layer, b))
                fed_only_by = tuple(
                    (c, p) for c, p in anatomy.fed_only_by if all(has_submodule(layer, n) for n in (c, *p))
                )
                attention = anatomy.attention if anatomy.attention and has_submodule(layer, anatomy.attention) else None
                session = LayerSession(
                    index, layer, prefix, targets, groups, inputs, device, model=model, blocks=blocks,
                    fed_only_by=fed_only_by, independent_groups=true_sequential, attention=attention, ranks=ranks,
                )  # fmt: skip
                process_layer(session, methods)
                observer = _output_observer(session, methods)
                inputs = session.outputs(observer) if observer else session.outputs()
                session.finish()
                restore_layer_dtype(layer, originals, session.biases)
                layer.to("cpu")
                quantized += len(session.quantized)
                rewritten += len(session.rewritten - set(session.quantized))
            carried = {f"{m.name}.{k}": v for m in methods for k, v in m.carried().items()}
            state.save_layer(session, inputs, carried, seconds=earlier + time.perf_counter() - start_time)
            state.map_layer(index, layer)  # the finished layer's packed weights leave RAM for its state file

    return {
        "layers": len(layers),
        "quantized_linears": quantized,
        **({"rewritten_linears": rewritten} if rewritten else {}),
        "resumed_at_layer": done if ctx.resume else None,
        **({"earlier_seconds": round(earlier, 2)} if done else {}),  # spent on the finished layers before resuming
        "seconds": round(time.perf_counter() - start_time, 2),
        "calibration": shape,
        **({"compute_dtype": "float32"} if widen else {}),
        **({"processes": ranks} if ranks > 1 else {}),  # each replayed its share of the samples
        "warnings": [w for m in methods for w in m.warnings],
    }


def run_one_shot_stage(
    model: nn.Module,
    configs: Sequence[Any],
    methods: Sequence[CalibrationMethod],
    target_for: Callable[[str], Any],
    ctx: StageContext,
    true_sequential: bool = True,
    batch_size: int = 4,
) -> dict:
    """What every one-shot stage handler does: unfuse MoE experts into linears, check each of ``configs`` against
    the model (``config.check(model)``, before any work), run ``methods`` in one pass (:func:`run_calibration`) and
    show the methods' warnings; returns the pass's summary with ``moe_blocks_unfused``."""
    moe_blocks = unfuse_experts(model)
    for config in configs:
        config.check(model)
    summary = run_calibration(model, methods, target_for, ctx, true_sequential, batch_size)
    for message in summary["warnings"]:
        ctx.bars.log(f"[yellow]warning[/yellow] {message}")
    return {**summary, "moe_blocks_unfused": moe_blocks}
