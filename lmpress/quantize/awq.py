"""AWQ weight quantization (Lin et al. 2023) on the layer-wise engine.

Sample recipe stage:

    - method: awq
      bits: 4
      group_size: 64
      symmetric: true
      grid: 20               # alphas 0, 1/20, ... 19/20 for s = s_X^alpha
      clip: true             # then the per-group weight clipping search
      search_samples: 16     # calibration samples the scale/clip searches run on
      rounding: gptq         # rtn | gptq: AWQ scales, then GPTQ rounding
      act_order: true        # GPTQ keys (damp_percent, block_size, act_order, static_groups,
      mse: true              #   mse, true_sequential) apply with rounding: gptq only
      ignore: [lm_head]

Per decoder layer: one pass over the search samples with the float weights
records the inputs of every scaling pair (``anatomy.scaling_pairs``: a norm or
linear, and the linears it feeds); each pair's scale is searched on the block
those linears belong to and folded into the pair (the float function is
unchanged); pairs whose channels cannot fold (v_proj -> o_proj under grouped-query
attention) are skipped. Then each linear's clipping range is searched (not for
q/k, whose errors the attention softmax amplifies, as in the reference), and
the layer is quantized by RTN or by GPTQ on all calibration samples.

FP4 (``fp4: nvfp4`` or ``mxfp4``): the scale and clipping searches quantize on the FP4 grid, and the weights
are rounded by RTN-FP4 (min/max block scales) or, with ``rounding: gptq``, by GPTQ-FP4:

    - method: awq
      fp4: nvfp4
      activations: fp4       # W4A4: input_global_scale = 448 * 6 / max|X| over the calibration inputs
      rounding: gptq
      ignore: [lm_head]

An NVFP4 W4A4 layer's ``input_global_scale`` comes from its inputs on all calibration samples after the
scales are folded (with ``rounding: rtn``, through the float layer, scaled and clipped; with ``rounding: gptq``,
where GPTQ gathers its Hessian). The searches quantize the weights only, not the activations.
"""

from __future__ import annotations

import re
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from lmpress.anatomy import get_anatomy
from lmpress.calib.engine import CalibrationMethod
from lmpress.calib.ranks import solve_across_ranks
from lmpress.calib.recorded import common_parent, record_search_batches
from lmpress.calib.session import LayerSession
from lmpress.calib.statistics import group_input_amax
from lmpress.quantize.awq_search import apply_clip, fold_scales, search_clip, search_scales
from lmpress.quantize.rtn import quantize_weight
from lmpress.quantize.scaling_pairs import foldable_pairs, run_scaling_stage
from lmpress.quantize.targets import GPTQ_ONLY_KEYS, GPTQRounding, needs_input_scale
from lmpress.registry import StageContext, register_stage
from lmpress.weights.fp4 import nvfp4_global_scale

NO_CLIP = re.compile(r"(^|\.)(q_proj|k_proj|query|key)$")


class AWQConfig(GPTQRounding):
    method: Literal["awq"] = "awq"
    grid: int = Field(20, ge=1, le=200)
    clip: bool = True
    clip_grid: int = Field(20, ge=1, le=200)
    clip_max_shrink: float = Field(0.5, gt=0, lt=1)
    clip_tokens: int = Field(512, ge=16)
    search_samples: int = Field(16, ge=1)
    rounding: Literal["rtn", "gptq"] = "rtn"

    @property
    def gathers_hessians(self) -> bool:  # type: ignore[override]
        return self.rounding == "gptq"

    @model_validator(mode="after")
    def _gptq_keys_need_gptq_rounding(self) -> AWQConfig:
        stray = [k for k in GPTQ_ONLY_KEYS if k in self.model_fields_set]
        if self.rounding == "rtn" and stray:
            raise ValueError(f"{', '.join(stray)} only apply with rounding: gptq (rounding is rtn)")
        return self


class AWQMethod(CalibrationMethod):
    """AWQ's scales and clipping on each layer, then RTN rounding; with ``rounding: gptq`` the stage's
    pass runs GPTQ after it (a second method of the same pass) and this method only scales and clips."""

    name = "awq"
    # spread: the search batches are recorded across the processes and gathered, the trials and clipping searches
    # shared out, the NVFP4 activation maxima reduced; every process then holds the same scaled, clipped layer
    reduces_across_ranks = True

    def __init__(self, config: AWQConfig, rounds: bool = True) -> None:
        super().__init__()
        self.config = config
        self.rounds = rounds  # False: a later method of the pass rounds (learned rounding's init: awq)
        self.skipped_pairs: set[str] = set()
        self.alphas: list[float] = []

    def pairs(self, session: LayerSession) -> list[tuple[str, list[str], str]]:
        """(source, linears, block) for each scaling pair this layer can take."""
        return [
            (prev, linears, common_parent(linears)) for prev, linears in foldable_pairs(session, self.skipped_pairs)
        ]

    def scale_and_clip(self, session: LayerSession) -> None:
        """Search, fold and clip: the float layer is rescaled (same function) and clipped, not yet quantized."""
        config = self.config
        pairs = self.pairs(session)
        clip_names = [n for n in session.targets if config.clip and not NO_CLIP.search(n)]
        watch = [block for _, _, block in pairs] + clip_names
        if not watch:
            return
        recorded = record_search_batches(session, watch, -(-config.search_samples // config.batch_size))
        for prev, linears, block in pairs:
            x_mean = torch.cat([t.reshape(-1, t.shape[-1]) for t in recorded.inputs[block]]).abs().mean(0)
            modules = [session.linear(n) for n in linears]
            block_module = session.layer.get_submodule(block)
            s, losses = search_scales(
                lambda block=block, module=block_module: recorded.run(module, block),
                modules,
                [session.targets[n] for n in linears],
                x_mean,
                config.grid,
                session.ranks,
            )
            self.alphas.append(losses.index(min(losses)) / config.grid)
            anatomy = get_anatomy(session.model)
            fold_scales(session.layer.get_submodule(prev), modules, s, anatomy.norm_offset, anatomy.rows_feeding(prev))
            recorded.divide(linears + [block], s)

        def clip(name: str) -> torch.Tensor:
            return search_clip(
                session.linear(name).weight.data, recorded.tokens(name, config.clip_tokens), session.targets[name],
                config.clip_grid, config.clip_max_shrink,
            )  # fmt: skip

        cost = {name: session.linear(name).weight.numel() for name in clip_names}
        for name, shrink in solve_across_ranks(clip_names, cost.__getitem__, clip, session.ranks).items():
            apply_clip(session.linear(name), shrink.to(session.device), session.targets[name])

    def prepare_layer(self, session: LayerSession) -> None:
        self.scale_and_clip(session)

    def process_group(self, session: LayerSession, group: list[str]) -> None:
        if not (self.rounds and self.config.rounding == "rtn"):
            return
        calibrated = [name for name in group if needs_input_scale(session.targets[name])]
        amax = group_input_amax(session, calibrated) if calibrated else {}
        for name in group:
            quantized = quantize_weight(session.linear(name).weight.data, session.targets[name], mse=False)
            if name in amax:
                quantized.input_global_scale = nvfp4_global_scale(amax[name].amax).cpu()
            session.apply(name, quantized)


def calibration_method(config: AWQConfig) -> AWQMethod:
    """AWQ's scales (and clipping, when ``config.clip``) alone, as the first method of another stage's pass
    (learned rounding's ``init: awq``): the later method rounds, so this one never quantizes."""
    return AWQMethod(config, rounds=False)


@register_stage("awq", AWQConfig)
@torch.no_grad()
def run_awq(model: nn.Module, config: AWQConfig, ctx: StageContext) -> dict:
    method = AWQMethod(config)
    summary = run_scaling_stage(model, config, ctx, method, "awq: scaling pairs that cannot fold, left unscaled")
    mean_alpha = sum(method.alphas) / len(method.alphas) if method.alphas else None
    return {
        **summary,
        "skipped_scaling_pairs": sorted(method.skipped_pairs),
        "mean_alpha": mean_alpha,
    }
