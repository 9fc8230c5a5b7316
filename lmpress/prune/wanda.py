"""Wanda (Sun, Liu, Bair, Kolter 2023, "A Simple and Effective Pruning Approach for Large Language Models").

Sample recipe stage:

    - method: wanda
      sparsity: 0.5              # fraction of each linear's weights set to zero
      pattern: unstructured      # or 2:4, 4:8
      ignore: []
      overrides:
        "model\\.layers\\.0\\..*": {sparsity: 0.3}
      true_sequential: true      # each group's norms from inputs of already-pruned predecessors
      batch_size: 4              # calibration samples per forward pass

The importance of weight W_ij is S_ij = |W_ij| · ||X_j||₂ (Eq. 1), X_j the j-th input
feature over every calibration token; weights are compared per output row (§3,
"comparison group"), and with N:M within each group of M inputs of a row. No
weight update. The norms come from the calibration engine (``calib.statistics``),
one pass per group of linears.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from lmpress.calib.engine import CalibrationMethod, run_one_shot_stage
from lmpress.calib.session import LayerSession
from lmpress.calib.statistics import group_input_norms
from lmpress.prune.masks import nm_mask, row_mask
from lmpress.prune.targets import PruneConfig, PruneTarget
from lmpress.registry import StageContext, register_stage


class WandaConfig(PruneConfig):
    method: Literal["wanda"] = "wanda"
    calibrates_layerwise: ClassVar[bool] = True
    spreads_across_processes: ClassVar[bool] = True
    true_sequential: bool = True
    batch_size: int = Field(4, ge=1, description="calibration samples per forward pass")


def wanda_prune_weight(
    W: torch.Tensor, input_norm: torch.Tensor, target: PruneTarget
) -> tuple[torch.Tensor, torch.Tensor]:
    """``W`` (out, in) pruned by S = |W| · ||X|| (Eq. 1) per output row; returns it and the mask (True = pruned)."""
    scores = W.detach().float().abs() * input_norm.float().reshape(1, -1)
    pruned = nm_mask(scores, target.n, target.m) if target.structured_nm else row_mask(scores, target.sparsity)
    return W.masked_fill(pruned, 0), pruned


class WandaMethod(CalibrationMethod):
    name = "wanda"
    reduces_across_ranks = True

    def process_group(self, session: LayerSession, group: list[str]) -> None:
        norms = group_input_norms(session, group)
        for name in group:
            weight, pruned = wanda_prune_weight(
                session.linear(name).weight.data, norms[name].norm, session.targets[name]
            )
            session.set_weight(name, weight, pruned)


@register_stage("wanda", WandaConfig)
@torch.no_grad()
def run_wanda(model: nn.Module, config: WandaConfig, ctx: StageContext) -> dict:
    return run_one_shot_stage(
        model, [config], [WandaMethod()], config.target_for, ctx, config.true_sequential, config.batch_size
    )
