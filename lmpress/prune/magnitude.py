"""Magnitude pruning: the weights of smallest |W| are zeroed; no calibration data (the floor other methods beat).

Sample recipe stage:

    - method: magnitude
      sparsity: 0.5              # fraction of each linear's weights set to zero
      pattern: unstructured      # or 2:4, 4:8 (N kept of every M along the input axis)
      ignore: []
      overrides:
        ".*mlp.down_proj": {sparsity: 0.4}

Unstructured magnitude compares the weights of a whole linear (Han et al. 2015, the
baseline of Sun et al. 2023, Table 1); N:M compares within each group of M.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from lmpress.prune.masks import matrix_mask, nm_mask
from lmpress.prune.targets import PruneConfig, PruneTarget
from lmpress.registry import StageContext, register_stage


class MagnitudeConfig(PruneConfig):
    method: Literal["magnitude"] = "magnitude"


def magnitude_prune_weight(W: torch.Tensor, target: PruneTarget) -> tuple[torch.Tensor, torch.Tensor]:
    """``W`` with its smallest-magnitude weights zeroed, and the mask of those (True = pruned)."""
    scores = W.detach().float().abs()
    pruned = nm_mask(scores, target.n, target.m) if target.structured_nm else matrix_mask(scores, target.sparsity)
    return W.masked_fill(pruned, 0), pruned


@register_stage("magnitude", MagnitudeConfig)
@torch.no_grad()
def run_magnitude(model: nn.Module, config: MagnitudeConfig, ctx: StageContext) -> dict:
    config.check(model)
    targets = config.targets(model)
    zeros = total = 0
    for _name, (module, target) in ctx.bars.track(targets.items(), "magnitude: layers", total=len(targets)):
        pruned_weight, pruned = magnitude_prune_weight(module.weight.data, target)
        module.weight.data.copy_(pruned_weight)
        zeros += int(pruned.sum())
        total += pruned.numel()
    return {"pruned_linears": len(targets), "sparsity": zeros / total if total else 0.0}
