"""The FP8 stage: every targeted linear layer becomes an ``Fp8Linear`` (lmpress.weights.float8: the format,
its arithmetic and where it runs).

Sample recipe stage:

    - method: fp8
      weights: channel       # channel | tensor: one weight scale per output row, or one per matrix
      ignore: [lm_head]
"""

from __future__ import annotations

import re
from typing import Literal

import torch
from torch import nn

from lmpress.registry import LayerPatterns, StageConfig, StageContext, register_stage
from lmpress.weights.float8 import Fp8Linear, Strategy, require_float8
from lmpress.weights.online_rotation import carry_input_rotation
from lmpress.weights.scheme import QuantScheme

FP8_WEIGHTS = QuantScheme(8, -1, True, "fp8")  # E4M3 weights with E4M3 activations, as the plans name them


class FP8Config(StageConfig):
    method: Literal["fp8"] = "fp8"
    weights: Strategy = "channel"
    ignore: LayerPatterns = ["lm_head"]

    def targets(self, model: nn.Module) -> dict[str, nn.Linear]:
        return {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not any(re.fullmatch(p, name) for p in self.ignore)
        }

    def quantized_linears(self, model: nn.Module) -> dict[str, tuple[nn.Linear, QuantScheme]]:
        """A byte per weight and a float32 scale per row (or matrix): 8-bit codes in one group per row."""
        return {name: (linear, FP8_WEIGHTS) for name, linear in self.targets(model).items()}

    def check(self, model: nn.Module) -> None:
        require_float8("stage fp8")

    def planned_schemes(self) -> list[tuple[str, QuantScheme]]:
        """E4M3 weights with E4M3 activations: only a format that describes quantized activations holds them."""
        return [("", FP8_WEIGHTS)]


@register_stage("fp8", FP8Config)
@torch.no_grad()
def run_fp8(model: nn.Module, config: FP8Config, ctx: StageContext) -> dict:
    config.check(model)
    targets = config.targets(model)
    for name, linear in ctx.bars.track(targets.items(), "fp8: layers", total=len(targets)):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        replacement = Fp8Linear.from_linear(linear, config.weights).train(linear.training)
        carry_input_rotation(linear, replacement)
        setattr(parent, child, replacement)
    return {"quantized_layers": len(targets), "weights": config.weights}
