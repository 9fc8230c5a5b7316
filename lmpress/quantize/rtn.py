"""Round-to-nearest weight quantization: min/max scales, no calibration data.

Sample recipe stage:

    - method: rtn
      bits: 4
      group_size: 64
      symmetric: true
      ignore: [lm_head]
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from lmpress.calib.moe import unfuse_experts
from lmpress.quantize.targets import WeightQuantConfig
from lmpress.registry import StageContext, register_stage
from lmpress.weights.apply import apply_quantized_weight
from lmpress.weights.scheme import quantize_weight_rtn


class RTNConfig(WeightQuantConfig):
    method: Literal["rtn"] = "rtn"


@register_stage("rtn", RTNConfig)
@torch.no_grad()
def run_rtn(model: nn.Module, config: RTNConfig, ctx: StageContext) -> dict:
    moe_blocks = unfuse_experts(model)  # fused MoE experts become one linear each, so every expert is quantized
    config.check(model)
    targets = config.targets(model)
    for name, (module, scheme) in ctx.bars.track(targets.items(), "rtn: layers", total=len(targets)):
        apply_quantized_weight(model, name, quantize_weight_rtn(module.weight.data, scheme))
    return {"quantized_layers": len(targets), "moe_blocks_unfused": moe_blocks}
