"""GPTQ weight quantization (Frantar et al. 2022) on the layer-wise engine.

Sample recipe stage:

    - method: gptq
      bits: 4
      group_size: 64
      symmetric: true
      act_order: true        # columns by decreasing Hessian diagonal (desc_act, g_idx)
      static_groups: false   # true: group scales from the original weights, no g_idx
      mse: true              # MSE-optimal scale/zero per group instead of min/max
      damp_percent: 0.01     # dampening, relative to the mean Hessian diagonal
      block_size: 128
      true_sequential: true  # q/k/v, then o, then gate/up, then down, each on quantized inputs
      ignore: [lm_head]
      overrides:
        ".*down_proj": {bits: 8}

The math lives in ``gptq_quantize.py``; this module only gathers each linear's
Hessian through ``lmpress.layerwise`` and writes the result into the model.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from lmpress.layerwise import LayerSession, run_layerwise
from lmpress.moe import unfuse_experts
from lmpress.quantize.gptq_quantize import HessianAccumulator, gptq_quantize_layer
from lmpress.quantize.targets import WeightQuantConfig
from lmpress.registry import StageContext, register_stage, stage_handler

log = logging.getLogger(__name__)


class GPTQRounding(WeightQuantConfig):
    """The GPTQ keys, shared by ``method: gptq`` and AWQ's ``rounding: gptq``."""

    damp_percent: float = Field(0.01, gt=0, le=1)
    block_size: int = Field(128, ge=1, le=4096)
    act_order: bool = False
    static_groups: bool = False
    mse: bool = False
    true_sequential: bool = True
    batch_size: int = Field(4, ge=1, description="calibration samples per forward pass")


@register_stage("gptq")
class GPTQConfig(GPTQRounding):
    method: Literal["gptq"] = "gptq"


def collect_hessians(session: LayerSession, names: list[str]) -> dict[str, HessianAccumulator]:
    """One pass over the calibration batches accumulating H = 2XXᵀ for each of ``names``.

    Linears fed the very same input tensor (q/k/v; gate/up; the experts of a MoE
    block) share one accumulator, so it is computed once.
    """
    hessians: dict[str, HessianAccumulator] = {}
    # Within a batch: input address -> (the input, kept alive so its address is not reused; its accumulator).
    by_input: dict[tuple, tuple[torch.Tensor, HessianAccumulator]] = {}
    last_batch = [-1]

    def on_input(name: str, batch: int, args: tuple, kwargs: dict) -> None:
        if batch != last_batch[0]:
            by_input.clear()
            last_batch[0] = batch
        x = args[0] if args else kwargs["input"]
        key = (x.data_ptr(), tuple(x.shape), x.dtype)
        shared = by_input[key][1] if key in by_input else None
        if name not in hessians:
            if shared is not None:
                hessians[name] = shared
                return
            hessians[name] = HessianAccumulator(x.shape[-1], x.device)
        if shared is hessians[name]:
            return
        hessians[name].add(x)
        by_input[key] = (x, hessians[name])

    session.forward(names, on_input, skip_watched=session.independent_groups)
    return hessians


def gptq_group(session: LayerSession, names: list[str], config: GPTQRounding, warnings: list[str]) -> None:
    """GPTQ-quantize linears ``names`` of the session's layer from one Hessian pass."""
    hessians = collect_hessians(session, names)
    for name in names:
        linear = session.linear(name)
        quantized, info = gptq_quantize_layer(
            linear.weight.data,
            hessians[name].H,
            session.targets[name],
            block_size=config.block_size,
            damp=config.damp_percent,
            act_order=config.act_order,
            static_groups=config.static_groups,
            mse=config.mse,
        )
        if info["damp"] != config.damp_percent:
            message = f"{session.prefix}{name}: Hessian not positive definite, dampening raised to {info['damp']}"
            log.warning(message)
            warnings.append(message)
        session.apply(name, quantized)


class GPTQMethod:
    name = "gptq"

    def __init__(self, config: GPTQRounding) -> None:
        self.config = config
        self.warnings: list[str] = []

    def process_layer(self, session: LayerSession) -> None:
        for group in session.groups:
            gptq_group(session, group, self.config, self.warnings)


def prepare_model(model: nn.Module, config: WeightQuantConfig) -> int:
    """Split fused MoE experts into linears and check the stage can run; returns the experts modules split."""
    split = unfuse_experts(model)
    config.check(model)
    return split


@stage_handler(GPTQConfig)
@torch.no_grad()
def run_gptq(model: nn.Module, config: GPTQConfig, ctx: StageContext) -> dict:
    moe_blocks = prepare_model(model, config)
    method = GPTQMethod(config)
    summary = run_layerwise(model, method, config.scheme_for, ctx, config.true_sequential, config.batch_size)
    for message in method.warnings:
        ctx.bars.log(f"[yellow]warning[/yellow] {message}")
    return {**summary, "moe_blocks_unfused": moe_blocks}
