"""SmoothQuant W8A8 (Xiao et al. 2022) on the layer-wise engine.

Xiao, Lin, Seznec, Wu, Demouth, Han, "SmoothQuant: Accurate and Efficient
Post-Training Quantization for Large Language Models" (ICML 2023, arXiv:2211.10438).

Activation outliers sit in a few input channels, which per-token int8 activation
quantization cannot represent without crushing every other channel. SmoothQuant
moves that difficulty into the weights with a per-channel factor ``s`` that
leaves the float function unchanged (Eq. 3):

    Y = (X diag(s)⁻¹) · (diag(s) Wᵀ)

with (Eq. 4) ``s_j = max|X_j|^α / max|W_j|^(1-α)``, ``max|X_j|`` over the
calibration tokens and ``max|W_j|`` over every linear that reads ``X``. ``X / s``
is folded into the preceding norm or linear and ``W · s`` into the linears
(``awq_search.fold_scales``, the same exact folding AWQ uses), so nothing is
added to the model. Then the weights are quantized to int8 per output channel
(round-to-nearest, or GPTQ in the same pass as AWQ composes it) and the layers run
W8A8: activations quantized per token at run time, one int8 GEMM
(``int8_linear.py``).

``alpha_search: true`` picks α per scaling pair from a grid, minimising the
block's output error on the calibration samples with the pair's linears running
simulated W8A8 (int8 weights of ``W·s``, per-token int8 activations of ``X/s``).
``smooth: false`` skips smoothing: plain W8A8, the baseline the smoothing gain is
measured against.

``activations: fp8`` makes the same stage FP8 W8A8 (``fp8.py``): E4M3 per-channel weights
(round-to-nearest, or GPTQ rounding onto the E4M3 grid) and dynamic per-token E4M3
activations. A float format keeps the same relative precision at every magnitude, but a
token's values more than ~2^14.8 below its largest one fall under E4M3's smallest normal
number (2^-6 after scaling the largest to 448) and lose their precision: smoothing the
outlier channels narrows that range, and the α search scores the FP8 simulation.

Sample recipe stage:

    - method: smoothquant
      alpha: 0.5             # migration strength α of Eq. 4 (or alpha_search: true)
      rounding: gptq         # rtn | gptq: int8 per-channel weights by GPTQ after smoothing
      damp_percent: 0.01     # GPTQ keys (block_size, act_order, static_groups, mse, true_sequential)
      ignore: [lm_head]      # with rounding: gptq only
      activations: int8      # int8 | fp8 (E4M3 weights and per-token activations)
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from lmpress.anatomy import get_anatomy
from lmpress.calib.engine import CalibrationMethod
from lmpress.calib.ranks import max_across_ranks_, solve_across_ranks
from lmpress.calib.recorded import RecordedInputs, common_parent, record_search_batches
from lmpress.calib.session import LayerSession
from lmpress.quantize.awq_search import fake_quantize_weight, fold_scales
from lmpress.quantize.scaling_pairs import foldable_pairs, run_scaling_stage
from lmpress.quantize.targets import GPTQ_ONLY_KEYS, GPTQRounding, GroupSize
from lmpress.registry import StageContext, register_stage
from lmpress.weights.float8 import (
    Fp8Weight,
    fake_quantize_fp8,
    fake_quantize_fp8_per_token,
    quantize_fp8,
    require_float8,
)
from lmpress.weights.int8_linear import fake_quantize_per_token
from lmpress.weights.scheme import QuantScheme, quantize_weight_rtn

RANGE_FLOOR = 1e-5


class SmoothQuantConfig(GPTQRounding):
    method: Literal["smoothquant"] = "smoothquant"
    bits: Literal[8] = 8
    group_size: GroupSize = -1
    activations: Literal["int8", "fp8"] = "int8"
    smooth: bool = True
    alpha: float = Field(0.5, ge=0, le=1)
    alpha_search: bool = False
    alpha_grid: int = Field(10, ge=1, le=100)
    search_samples: int = Field(8, ge=1)
    rounding: Literal["rtn", "gptq"] = "rtn"

    @property
    def gathers_hessians(self) -> bool:  # type: ignore[override]
        return self.rounding == "gptq"

    @model_validator(mode="after")
    def _consistent(self) -> SmoothQuantConfig:
        if self.group_size != -1:
            raise ValueError(
                f"{self.activations} per-token activations need per-channel weight scales (group_size: -1), "
                f"got group_size {self.group_size}: an int8 matrix product can only rescale whole output rows"
            )
        if not self.symmetric:
            raise ValueError(f"{self.activations} matrix multiplication needs symmetric weights (symmetric: true)")
        if self.activations == "fp8" and self.mse:
            raise ValueError("mse: true searches integer grids; FP8 weights take max|w| / 448 per channel")
        if self.overrides:
            raise ValueError("overrides are not supported: every W8A8 layer is 8-bit per-channel; use ignore")
        stray = [k for k in GPTQ_ONLY_KEYS if k in self.model_fields_set]
        if self.rounding == "rtn" and stray:
            raise ValueError(f"{', '.join(stray)} only apply with rounding: gptq (rounding is rtn)")
        if not self.smooth and {"alpha", "alpha_search", "alpha_grid"} & self.model_fields_set:
            raise ValueError("alpha, alpha_search and alpha_grid only apply with smooth: true")
        if self.alpha_search and "alpha" in self.model_fields_set:
            raise ValueError("give alpha or alpha_search: true, not both")
        return self

    def scheme_for(self, name: str) -> QuantScheme | None:
        scheme = super().scheme_for(name)
        return None if scheme is None else dataclasses.replace(scheme, activations=self.activations)

    def planned_schemes(self) -> list[tuple[str, QuantScheme]]:
        return [(where, dataclasses.replace(s, activations=self.activations)) for where, s in super().planned_schemes()]


def smoothing_factors(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """Eq. 4: ``s_j = max|X_j|^α / max|W_j|^(1-α)`` (ranges floored at 1e-5, as the reference code does)."""
    x_max = x_max.float().clamp(min=RANGE_FLOOR)
    w_max = w_max.float().clamp(min=RANGE_FLOOR)
    return (x_max.pow(alpha) / w_max.pow(1 - alpha)).clamp(min=RANGE_FLOOR)


def weight_ranges(linears: list[nn.Linear]) -> torch.Tensor:
    """``max|W_j|`` per input channel over every linear in ``linears`` (they share their input)."""
    return torch.stack([linear.weight.detach().float().abs().amax(dim=0) for linear in linears]).amax(dim=0)


class _ChannelRanges:
    """Running ``max|X_j|`` of each watched linear's input over the calibration tokens."""

    def __init__(self) -> None:
        self.ranges: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, batch: int, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs["hidden_states"]
        current = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).float().cpu()
        previous = self.ranges.get(name)
        self.ranges[name] = current if previous is None else torch.maximum(previous, current)


@torch.no_grad()
def simulated_w8a8(linears: list[nn.Linear], s: torch.Tensor, activations: str = "int8") -> list:
    """Make ``linears`` compute what they will after smoothing by ``s`` and W8A8 quantization, in float.

    Each weight becomes ``Q_w(W·s)/s`` and each input ``Q_x(X/s)·s`` (a forward pre-hook), so the product is
    ``Q_x(X/s) · Q_w(W·s)ᵀ``; ``Q`` rounds to int8 or to E4M3 (``activations``). Returns the undo list for
    :func:`restore`.
    """
    if activations == "fp8":
        quantize_weight, quantize_tokens = fake_quantize_fp8, fake_quantize_fp8_per_token
    else:
        scheme = QuantScheme(8, -1, True)
        quantize_weight, quantize_tokens = (lambda w: fake_quantize_weight(w, scheme)), fake_quantize_per_token
    undo = []
    for linear in linears:
        w = linear.weight.data
        scale = s.to(w.device, w.dtype)
        linear.weight.data = quantize_weight(w * scale) / scale

        def quantize_input(module: nn.Module, args: tuple, scale: torch.Tensor = scale) -> tuple:
            return (quantize_tokens(args[0] / scale) * scale, *args[1:])

        undo.append((linear, w, linear.register_forward_pre_hook(quantize_input)))
    return undo


def restore(undo: list) -> None:
    for linear, weight, handle in undo:
        linear.weight.data = weight
        handle.remove()


class SmoothQuantMethod(CalibrationMethod):
    """Smoothing (Eq. 3-4) of every foldable scaling pair of the layer, then int8 RTN rounding; with
    ``rounding: gptq`` the stage's pass runs GPTQ after it and this method only smooths."""

    name = "smoothquant"
    # spread: the channel maxima reduced by max (exact), the α search's batches recorded across the processes and
    # gathered, its trials shared out
    reduces_across_ranks = True

    def __init__(self, config: SmoothQuantConfig) -> None:
        super().__init__()
        self.config = config
        self.skipped_pairs: set[str] = set()
        self.alphas: list[float] = []
        self.smoothed = 0

    def search_alpha(
        self, recorded: RecordedInputs, module: nn.Module, block: str, linears: list[nn.Linear], x_max: torch.Tensor,
        w_max: torch.Tensor, ranks: int = 1,
    ) -> tuple[torch.Tensor, float]:  # fmt: skip
        """The α on the grid whose simulated W8A8 output of ``block`` is closest (MSE) to its float output;
        ``ranks`` > 1: the launched processes share the trials (each holds the same recording)."""
        reference = recorded.run(module, block)
        grid = self.config.alpha_grid

        def trial_loss(i: int) -> float:
            undo = simulated_w8a8(linears, smoothing_factors(x_max, w_max, i / grid), self.config.activations)
            try:
                outputs = recorded.run(module, block)
            finally:
                restore(undo)
            return sum(torch.mean((o.float() - r.float()) ** 2).item() for o, r in zip(outputs, reference, strict=True))

        losses = solve_across_ranks(range(grid + 1), lambda i: 1.0, trial_loss, ranks)  # every rank: every loss
        best, best_loss = 0, float("inf")
        for i, loss in losses.items():
            if loss < best_loss:
                best, best_loss = i, loss
        return smoothing_factors(x_max, w_max, best / grid), best / grid

    def smooth_layer(self, session: LayerSession) -> None:
        pairs = foldable_pairs(session, self.skipped_pairs)
        if not pairs:
            return
        ranges = _ChannelRanges()
        session.forward([linears[0] for _, linears in pairs], ranges)
        if session.ranks > 1:  # each process saw its share of the batches: the maxima over all of them
            for name in sorted(ranges.ranges):
                ranges.ranges[name] = ranges.ranges[name].to(session.device)
                max_across_ranks_(ranges.ranges[name])
        recorded = None
        if self.config.alpha_search:
            blocks = list(dict.fromkeys(common_parent(linears) for _, linears in pairs))
            n_batches = -(-self.config.search_samples // self.config.batch_size)
            recorded = record_search_batches(session, blocks, n_batches)
        for prev, names in pairs:
            linears = [session.linear(n) for n in names]
            x_max = ranges.ranges[names[0]].to(session.device)
            w_max = weight_ranges(linears)
            if recorded is None:
                s, alpha = smoothing_factors(x_max, w_max, self.config.alpha), self.config.alpha
            else:
                block = common_parent(names)
                module = session.layer.get_submodule(block)
                s, alpha = self.search_alpha(recorded, module, block, linears, x_max, w_max, session.ranks)
                recorded.divide(names + [block], s)
            anatomy = get_anatomy(session.model)
            fold_scales(
                session.layer.get_submodule(prev), linears, s.to(session.device), anatomy.norm_offset,
                anatomy.rows_feeding(prev),
            )  # fmt: skip
            self.alphas.append(alpha)
            self.smoothed += 1

    def prepare_layer(self, session: LayerSession) -> None:
        if self.config.smooth:
            self.smooth_layer(session)

    def process_group(self, session: LayerSession, group: list[str]) -> None:
        if self.config.rounding == "rtn":
            for name in group:
                w = session.linear(name).weight.data
                if self.config.activations == "fp8":
                    session.apply(name, Fp8Weight(*quantize_fp8(w, "channel"), "channel"))
                else:
                    session.apply(name, quantize_weight_rtn(w, session.targets[name]))


@register_stage("smoothquant", SmoothQuantConfig)
@torch.no_grad()
def run_smoothquant(model: nn.Module, config: SmoothQuantConfig, ctx: StageContext) -> dict:
    if config.activations == "fp8":
        require_float8("stage smoothquant (activations: fp8)")
    method = SmoothQuantMethod(config)
    summary = run_scaling_stage(model, config, ctx, method, "smoothquant: pairs that cannot fold, left unsmoothed")
    return {
        **summary,
        "smoothed_pairs": method.smoothed,
        "skipped_scaling_pairs": sorted(method.skipped_pairs),
        "mean_alpha": sum(method.alphas) / len(method.alphas) if method.alphas else None,
    }
