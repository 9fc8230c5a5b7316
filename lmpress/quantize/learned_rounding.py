"""Learned rounding: per-block sign-gradient descent on rounding offsets and clipping, on the layer-wise engine.

Cheng, Zhang, Shen, Meng, Guo, Liu, Lv, "Optimize Weight Rounding via Signed
Gradient Descent for the Quantization of LLMs" (arXiv:2309.05516, "SignRound").

Sample recipe stage:

    - method: learned
      bits: 4
      group_size: 64
      symmetric: true
      iterations: 200        # sign-gradient steps per decoder layer (1..10000)
      lr: null               # step size, 0 < lr <= 1; null: 1/iterations (the paper's default); decays linearly to 0
      batch_size: 8          # calibration samples per step (and per forward pass of the engine)
      samples: null          # calibration samples the steps draw from (null: all of data.samples)
      init: rtn              # rtn | awq (AWQ's scales folded first, same pass) | gptq (V from GPTQ's codes) | awq+gptq
      full_range: false      # symmetric only: the group's extreme on code 0 (s = −m/2^(b−1), sign and all)
      reference: model       # model: match the unquantized model's block output | layer: the unquantized block's
      seed: 0                # the order of the batches; same seed, same machine: the same artifact
      ignore: [lm_head]

The paper's quantization function, for each linear of the block (lines marked
``# W~`` below):

    W~ = s · (clamp(⌊W/s + V⌉ + zp, 0, 2^b − 1) − zp)
    asymmetric: s = (max(W)·α − min(W)·β) / (2^b − 1),  zp = ⌊−min(W)·β / s⌉
    symmetric (lmpress's grid, ``scheme.py``): s = 2·max|W|·α / (2^b − 1),  zp = 2^(b−1)  (β unused)
    symmetric, ``full_range``:                s = −m / 2^(b−1),  zp = 2^(b−1),
        m = max(W)·α if max(W)·α ≥ −min(W)·β else min(W)·β  (the group's extreme, clipped, sign and all)

``full_range`` is the grid of llama.cpp's Q4_0 and of auto-round's symmetric
quantizer: the extreme lands exactly on code 0 and the other side of zero gets
2^(b−1) − 1 steps, so the step is |m|/2^(b−1) instead of lmpress's 2|m|/(2^b − 1)
(finer by a factor 2^b/(2^b − 1)) and the extreme itself is never clipped; a negative extreme
gives a negative scale, which every packed format holds (dequantization is (q − zp)·s).
Measured on SmolLM2-135M (W4 g64, the full-quality recipe, bench/quant_table.py): 23.10 with
it against 22.84 without, so it is off by default.

with V ∈ [−0.5, 0.5] per weight (init 0), α, β ∈ [0.5, 1] per output row and
group (init 1), min/max taken per group, and ⌊·⌉ rounding with a straight-through
gradient. Per decoder layer, V, α and β of every target linear are learned
together on the layer's output error. Its input X~ is what the already-quantized
layers before it produce; its target, with ``reference: model`` (the default), is
the block's output in the unquantized model, f(X; W) on that model's own input X,
so each block also makes up for the error the blocks before it left (as SignRound's
implementation, auto-round's ``quant_block``, takes its targets from the float inputs and
trains on the quantized ones, ``q_input``);
with ``reference: layer``, the unquantized block on the same input, f(X~; W):

    L = ‖f(X; W) − f(X~; W~)‖²  (mean over elements)
    V ← clamp(V − lr_t · sign(∂L/∂V), −0.5, 0.5);  α, β likewise in [0.5, 1];  lr_t = lr · (1 − t/T)

one calibration batch per step, keeping the iterate with the lowest loss seen (the
paper compares each step's loss on its own batch; here relative to the starting
rounding's loss on that batch, so an easy batch does not pass for a good iterate). The learned values are then
frozen into the packed form every exporter reads (``QuantizedWeight``: codes,
scales, zeros). This is the only lmpress method that takes gradients: it turns
them on locally (``torch.enable_grad``) inside its own step; the engine, the
evals and the exporters stay inference-only.

FP4 (``fp4: nvfp4`` or ``mxfp4``; ``activations: fp4`` for W4A4): each block's scale is the format's min/max
scale of its range clipped by α (an E4M3 value under NVFP4's per-tensor global scale, or a power of two; α's
gradient passes straight through that rounding), and each weight takes the E2M1 value just below or just above
w/s, the one above where ⌊t + V⌉ = 1, t being w/s's position between the two (V = 0 is round-to-nearest;
straight-through, ∂W~/∂V is the gap between the two values; ``fp4_rounding.py``); β is unused. NVFP4 W4A4 layers
take ``input_global_scale = 448 · 6 / max|X|`` over their float inputs on every calibration sample; the loss
quantizes the weights only, not the activations. ``full_range`` is an integer grid: FP4 refuses it.

``init: awq`` runs AWQ's scale search (no clipping: α, β learn the range) as the
first method of the same pass, so the learned rounding starts from the
rescaled weights; ``init: gptq`` starts from GPTQ's rounding (act-order within static
groups, MSE-searched scales): α = β from its scales, V from its codes, clamped into
[−0.5, 0.5]; ``init: awq+gptq``
does both (GPTQ's codes of the rescaled weights).

A step's squared error and its gradient with respect to each W~ are summed over the batch's samples one sample at
a time in float64 (``summed_over_samples``), then taken through the fake quantization once. Across launched
processes (``torchrun``; ``calib.ranks``) each process holds its part of every batch's samples and the parts'
float64 sums are added before the sign step, so two processes take one process's steps bit for bit
(docs/scale.md); with ``init: awq`` the pass runs in full in every process (AWQ's search shares whole batches).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import nn
from torch.func import functional_call

from lmpress.calib.activations import map_tensors
from lmpress.calib.engine import CalibrationMethod, run_one_shot_stage
from lmpress.calib.hooks import first_input, move_to
from lmpress.calib.ranks import add_across_ranks_, column_solve_cost, count_across_ranks, solve_across_ranks
from lmpress.calib.session import LayerSession
from lmpress.calib.statistics import HessianAccumulator, group_input_amax
from lmpress.errors import LmpressInputError
from lmpress.memory import freed_heap_reused
from lmpress.quantize.gptq_quantize import gptq_quantize_layer
from lmpress.quantize.learned_rounding_quantize import (
    CLIP_RANGE,
    V_RANGE,
    Rounding,
    freeze,
    init_rounding,
    learned_fake_quantize,
)
from lmpress.quantize.targets import WeightQuantConfig, needs_input_scale
from lmpress.registry import StageContext, register_stage, stage_config
from lmpress.registry import calibration_method as method_by_name
from lmpress.weights.fp4 import nvfp4_global_scale
from lmpress.weights.scheme import QuantizedWeight, QuantScheme

MAX_ITERATIONS = 10_000


class LearnedRoundingConfig(WeightQuantConfig):
    method: Literal["learned"] = "learned"
    calibrates_layerwise: ClassVar[bool] = True
    iterations: int = Field(200, ge=1, le=MAX_ITERATIONS)
    lr: float | None = Field(None, gt=0, le=1, description="null: 1/iterations")
    batch_size: int = Field(8, ge=1, le=1024, description="calibration samples per step and per forward pass")
    samples: int | None = Field(None, ge=1, description="calibration samples the steps draw from (null: all)")
    init: Literal["rtn", "awq", "gptq", "awq+gptq"] = "rtn"
    reference: Literal["model", "layer"] = Field(
        "model", description="target: the unquantized model's block output, or the unquantized block on the same input"
    )
    seed: int = Field(0, ge=0)
    full_range: bool = Field(
        False, description="symmetric only: scale -m/2^(b-1) from the group's signed extreme m (llama.cpp's Q4_0 grid)"
    )

    @model_validator(mode="after")
    def _no_kquant_scales(self) -> LearnedRoundingConfig:
        if any(scheme.k_quant_scales for _, scheme in self.planned_schemes()):
            raise ValueError(
                "method learned does not keep k_quant_scales (its learned clipping moves each group's scale off "
                "the grid); use method rtn, gptq or awq for Q4_K-ready scales"
            )
        return self

    @model_validator(mode="after")
    def _full_range_is_symmetric(self) -> LearnedRoundingConfig:
        if self.full_range and not all(scheme.symmetric for _, scheme in self.planned_schemes()):
            raise ValueError("full_range is a symmetric grid: set symmetric: true (or full_range: false)")
        if self.full_range and any(scheme.fp4 for _, scheme in self.planned_schemes()):
            raise ValueError("full_range is an integer grid (Q4_0's); FP4 layers take their format's block scales")
        return self

    @property
    def step_size(self) -> float:
        return self.lr if self.lr is not None else 1.0 / self.iterations

    @property
    def spreads_across_processes(self) -> bool:  # type: ignore[override]
        """Across launched processes each step's batch is shared out by samples; with AWQ's search in the pass
        (init: awq), which shares whole batches, the pass runs in full in every process."""
        return not self.init.startswith("awq")

    @property
    def shares_batch_rows(self) -> bool:  # type: ignore[override]
        return self.spreads_across_processes

    @property
    def gathers_hessians(self) -> bool:  # type: ignore[override]
        return self.init.endswith("gptq")  # GPTQ's start


def block_output(out: torch.Tensor | tuple) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def sample_kwargs(kwargs: dict, j: int, n: int) -> dict:
    """Sample ``j``'s keyword arguments from a batch of ``n``'s: tensors with a batch dimension of ``n`` (masks)
    sliced to its row, the rest (rotary tables and positions the batch shares) as they are."""
    if n == 1:
        return kwargs
    return map_tensors(kwargs, lambda t: t[j : j + 1] if t.dim() and t.shape[0] == n else t)


def summed_over_samples(
    block: nn.Module,
    weights: dict[str, torch.Tensor],
    hidden: torch.Tensor,
    kwargs: dict,
    target: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The block's squared error against ``target`` with the linears' weights ``weights`` (name -> W~), one sample
    of ``hidden`` at a time, and, for the weights that require grad, its gradient: each sample's float32 values
    summed in float64 in sample order. Per sample, so that the batch's sum does not depend on how launched
    processes share its samples (a batched backward pass sums over all of its rows in float32, in an order its
    GEMM chooses); a float64 sum of float32 terms is exact unless their magnitudes span more than ~2^28."""
    learnable = {name: w for name, w in weights.items() if w.requires_grad}
    error = torch.zeros((), dtype=torch.float64, device=hidden.device)
    grads = {name: torch.zeros_like(w, dtype=torch.float64) for name, w in learnable.items()}
    for j in range(len(hidden)):
        out = block_output(functional_call(block, weights, (hidden[j : j + 1],), sample_kwargs(kwargs, j, len(hidden))))
        sample_error = torch.sum((out.float() - target[j : j + 1]) ** 2)
        if learnable:
            sample_grads = torch.autograd.grad(sample_error, list(learnable.values()))
            for total, g in zip(grads.values(), sample_grads, strict=True):
                total += g
        error += sample_error.detach()
    return error, grads


def learn_block_rounding(
    block: nn.Module,
    weights: dict[str, tuple[torch.Tensor, QuantScheme]],
    batch: Callable[[int], tuple[torch.Tensor, dict]],
    targets: list[torch.Tensor],
    iterations: int,
    lr: float,
    seed: int,
    start: dict[str, Rounding] | None = None,
    full_range: bool = False,
    ranks: int = 1,
) -> tuple[dict[str, Rounding], dict]:
    """Sign-gradient descent on the rounding of the linears ``weights`` (name in ``block`` -> (float weight,
    scheme)) against ``targets[i]``, the unquantized block's output on ``batch(i)`` (hidden, kwargs).

    Each step takes one batch (a seeded permutation, repeated as needed). Batches differ in how hard they
    are, so an iterate's loss is compared with the starting rounding's loss on the same batch (computed first,
    one forward pass per batch): returns the rounding whose step had the lowest such ratio (the start's is 1)
    and ``{"start_loss" (mean over the batches), "best_relative_loss", "best_step"}``.

    A step's squared error and its gradient with respect to each W~ are sums over the batch's samples in float64
    (``summed_over_samples``); ``ranks`` > 1: launched processes share each batch's samples (``calib.ranks``),
    ``batch(i)`` and ``targets[i]`` being this process's part, and their float64 sums are added, which is exact
    where the one process's sum is: every process takes the one process's steps, bit for bit.
    """
    rounding = start or {name: init_rounding(w, scheme, full_range=full_range) for name, (w, scheme) in weights.items()}
    for r in rounding.values():
        for t in r.tensors():
            t.requires_grad_(True)
    learnable = [t for r in rounding.values() for t in r.tensors()]
    frozen = [p for p in block.parameters() if p.requires_grad]
    dtype = next(block.parameters()).dtype

    # elements of each whole batch: the squared error's sum over them / their count is the batch's mean
    sizes = torch.tensor([t.numel() for t in targets], dtype=torch.float64)
    if ranks > 1:
        add_across_ranks_(sizes)

    def quantized() -> dict[str, torch.Tensor]:
        return {
            f"{name}.weight": learned_fake_quantize(w, scheme, rounding[name]).to(dtype)
            for name, (w, scheme) in weights.items()
        }

    def mean_error(index: int, weights_now: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
        """Batch ``index``'s mean squared error (L = ‖f(X; W) − f(X~; W~)‖²) and its gradient per W~."""
        hidden, kwargs = batch(index)
        error, grads = summed_over_samples(block, weights_now, hidden, kwargs, targets[index])
        if ranks > 1:
            error, grads = summed_over_ranks(error, grads)
        return error.item() / sizes[index].item(), {name: g / sizes[index].item() for name, g in grads.items()}

    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    best, best_relative, best_step = {n: r.clone() for n, r in rounding.items()}, float("inf"), 0
    for p in frozen:
        p.requires_grad_(False)
    try:
        with torch.no_grad():
            start_weights = quantized()
            start_losses = [mean_error(i, start_weights)[0] for i in range(len(targets))]
        with torch.enable_grad():
            for step in range(iterations):
                if not order:
                    order = torch.randperm(len(targets), generator=generator).tolist()
                index = order.pop()
                weights_now = quantized()
                leaves = {name: w.detach().requires_grad_(True) for name, w in weights_now.items()}
                loss_value, weight_grads = mean_error(index, leaves)
                grads = torch.autograd.grad(
                    list(weights_now.values()), learnable,
                    grad_outputs=[weight_grads[name].to(w.dtype) for name, w in weights_now.items()],
                    allow_unused=True,
                )  # fmt: skip
                relative = loss_value / max(start_losses[index], torch.finfo(torch.float32).tiny)
                if relative < best_relative:
                    best, best_relative, best_step = {n: r.clone() for n, r in rounding.items()}, relative, step
                step_lr = lr * (1 - step / iterations)  # lr_t = lr · (1 − t/T)
                with torch.no_grad():
                    for t, g in zip(learnable, grads, strict=True):
                        if g is not None:  # β has no gradient under a symmetric scheme
                            t.sub_(step_lr * g.sign())  # V ← V − lr_t · sign(∂L/∂V), α and β likewise
                    for r in rounding.values():
                        r.v.clamp_(*V_RANGE)
                        r.alpha.clamp_(*CLIP_RANGE)
                        r.beta.clamp_(*CLIP_RANGE)
    finally:
        for p in frozen:
            p.requires_grad_(True)
    start_loss = sum(start_losses) / len(start_losses)
    return best, {"start_loss": start_loss, "best_relative_loss": best_relative, "best_step": best_step}


def summed_over_ranks(
    error: torch.Tensor, grads: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A batch's float64 squared error and gradients summed over the launched processes' parts, in one collective."""
    flat = torch.cat([g.reshape(-1) for g in grads.values()] + [error.reshape(1)])
    add_across_ranks_(flat)
    summed, offset = {}, 0
    for name, g in grads.items():
        summed[name] = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
    return flat[-1], summed


# On the engine -----------------------------------------------------------------------------------


@torch.no_grad()
def layer_hessians(
    layer: nn.Module,
    names: list[str],
    batch: Callable[[int], tuple[torch.Tensor, dict]],
    n_batches: int,
    ranks: int = 1,
) -> dict[str, torch.Tensor]:
    """H = 2XXᵀ of the inputs of each linear ``names`` of ``layer`` (float weights) over ``n_batches`` batches
    (``ranks`` > 1: over every launched process's part of them). Each sample's XᵀX is a term of its own (the
    accumulator's float32 product, float64 sum), so the sum does not depend on how processes share a batch's
    samples: a batch's product would sum its samples' tokens in float32, and half a batch's in another order."""
    accumulators: dict[str, HessianAccumulator] = {}

    def hook_for(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = first_input(args, kwargs)
            if name not in accumulators:
                accumulators[name] = HessianAccumulator(x.shape[-1], x.device)
            for sample in x if x.dim() == 3 else x[None]:  # (batch, tokens, features); an expert's routed tokens whole
                accumulators[name].add(sample)

        return hook

    handles = [layer.get_submodule(n).register_forward_pre_hook(hook_for(n), with_kwargs=True) for n in names]
    try:
        for i in range(n_batches):
            hidden, kwargs = batch(i)
            layer(hidden, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    if ranks > 1:
        for name in names:  # in the same order on every process
            accumulators[name].reduce_across_ranks()
    return {name: acc.H for name, acc in accumulators.items()}


class LearnedRoundingMethod(CalibrationMethod):
    """The whole layer's rounding learned in ``prepare_layer`` (it needs every linear at once), then applied."""

    name = "learned"
    reduces_across_ranks = True
    spreads_rows = True  # one batch a step: the processes share each step's batch

    def __init__(self, config: LearnedRoundingConfig) -> None:
        super().__init__()
        self.config = config
        self.losses: list[tuple[float, float]] = []  # (the start's mean loss, best loss / the start's) per layer
        # reference: model — the unquantized model's inputs to the next layer, for the training batches
        self.reference_inputs: list[torch.Tensor] | None = None

    def carried(self) -> dict[str, torch.Tensor]:
        return {str(i): h for i, h in enumerate(self.reference_inputs or [])}

    def restore_carried(self, tensors: dict[str, torch.Tensor]) -> None:
        self.reference_inputs = [tensors[str(i)] for i in range(len(tensors))] or None

    def training_batches(self, session: LayerSession) -> int:
        n = len(session.inputs.hidden)
        if self.config.samples is None:
            return n
        wanted = -(-self.config.samples // self.config.batch_size)
        if wanted > n and not self.warnings:
            rows = sum(session.inputs.hidden.rows)
            rows = count_across_ranks(rows) if session.ranks > 1 else rows
            self.warnings.append(f"learned: samples {self.config.samples} > the {rows} calibration samples; using all")
        return min(n, wanted)

    def prepare_layer(self, session: LayerSession) -> None:
        names, config = list(session.targets), self.config
        if not names and config.reference == "layer":
            return
        n_batches = self.training_batches(session)
        dtype = next(session.layer.parameters()).dtype

        def batch(i: int) -> tuple[torch.Tensor, dict]:
            hidden = session.inputs.hidden[i].to(session.device, dtype)
            return hidden, move_to(session.inputs.kwargs[i], session.device)

        with torch.no_grad():  # the unquantized layer's outputs: what each step's output is compared with
            targets = []
            for i in range(n_batches):
                hidden, kwargs = batch(i)
                if config.reference == "model":
                    hidden = self._reference_input(session, i, hidden)
                targets.append(block_output(session.layer(hidden, **kwargs)).float())
        if config.reference == "model":
            self.reference_inputs = [t.cpu() for t in targets]  # the unquantized model's next-layer inputs
        if not names:
            return
        weights = {name: (session.linear(name).weight.data, session.targets[name]) for name in names}
        start = None
        if config.init.endswith("gptq"):
            hessians = layer_hessians(session.layer, names, batch, n_batches, session.ranks)

            def gptq_codes(name: str) -> QuantizedWeight:
                # lmpress's GPTQ recipe: act-order within static groups (no g_idx), MSE-searched scales
                w, scheme = weights[name]
                return gptq_quantize_layer(w, hessians[name], scheme, act_order=True, static_groups=True, mse=True)[0]

            cost = {name: column_solve_cost(weights[name][0]) for name in names}
            codes = solve_across_ranks(names, cost.__getitem__, gptq_codes, session.ranks)
            start = {
                name: init_rounding(w, scheme, codes[name], full_range=config.full_range)
                for name, (w, scheme) in weights.items()
            }
        # NVFP4 W4A4: each linear's static activation scale from its float inputs on every calibration sample
        calibrated = [name for name in names if needs_input_scale(session.targets[name])]
        amax = group_input_amax(session, calibrated) if calibrated else {}
        with freed_heap_reused():  # each step's buffers reused, not mapped afresh: 4.5 s against 6.8 a layer
            best, info = learn_block_rounding(
                session.layer, weights, batch, targets, config.iterations, config.step_size,
                seed=config.seed * 100_003 + session.index, start=start, full_range=config.full_range,
                ranks=session.ranks,
            )  # fmt: skip
        del targets
        self.losses.append((info["start_loss"], info["best_relative_loss"]))
        for name, (w, scheme) in weights.items():
            quantized = freeze(w, scheme, best[name])
            if name in amax:
                quantized.input_global_scale = nvfp4_global_scale(amax[name].amax).cpu()
            session.apply(name, quantized)

    def _reference_input(self, session: LayerSession, i: int, quantized_input: torch.Tensor) -> torch.Tensor:
        """The unquantized model's input to this layer for training batch ``i`` (layer 0: the same as the engine's)."""
        if session.index == 0:
            return quantized_input
        if self.reference_inputs is None:
            raise LmpressInputError(
                "learned (reference: model): the saved state lacks the unquantized model's activations; "
                "run without --resume"
            )
        return self.reference_inputs[i].to(session.device, quantized_input.dtype)


def calibration_method(config: LearnedRoundingConfig) -> LearnedRoundingMethod:
    return LearnedRoundingMethod(config)


def awq_scales_method(config: LearnedRoundingConfig) -> CalibrationMethod:
    """AWQ's scale search and folding (no clipping: α and β learn the range; no rounding) as the pass's first
    method, built by name so this module does not import AWQ's."""
    scheme_keys = ("bits", "group_size", "symmetric", "fp4", "activations")
    awq = stage_config("awq")(
        **{key: getattr(config, key) for key in scheme_keys if key in config.model_fields_set},
        ignore=config.ignore,
        overrides={k: v.model_dump(exclude_none=True) for k, v in config.overrides.items()},
        clip=False,
        batch_size=config.batch_size,
    )
    return method_by_name("awq", awq)


@register_stage("learned", LearnedRoundingConfig)
@torch.no_grad()
def run_learned(model: nn.Module, config: LearnedRoundingConfig, ctx: StageContext) -> dict:
    method = LearnedRoundingMethod(config)
    methods = [awq_scales_method(config), method] if config.init.startswith("awq") else [method]
    summary = run_one_shot_stage(model, [config], methods, config.scheme_for, ctx, False, config.batch_size)
    ratios = [relative for _, relative in method.losses]
    return {
        **summary,
        "iterations": config.iterations,
        "lr": config.step_size,
        "init": config.init,
        # the kept iterate's loss / the start's (RTN, AWQ or GPTQ) on its batch, over the layers this run computed
        "mean_loss_ratio": sum(ratios) / len(ratios) if ratios else None,
    }
