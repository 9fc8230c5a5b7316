"""Round-to-nearest weight quantization: min/max scales, no calibration data.

Sample recipe stage:

    - method: rtn
      bits: 4
      group_size: 64
      symmetric: true
      ignore: [lm_head]

FP4 (``fp4: nvfp4`` in blocks of 16 with E4M3 scales, or ``fp4: mxfp4`` in blocks of 32 with power-of-two
scales; ``lmpress.weights.fp4``), with the block scales searched for the least squared error:

    - method: rtn
      fp4: nvfp4
      mse: true
      ignore: [lm_head]

``mse: true`` on an integer grid searches each group's clipping range (GPTQ's ``mse`` option, the same search).
W4A4 NVFP4 (``activations: fp4``) needs each layer's activation range from calibration data: use ``gptq``; MXFP4
activations scale per block at run time and take RTN.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import model_validator
from torch import nn

from lmpress.calib.moe import unfuse_experts
from lmpress.quantize.mse_scales import search_qparams_mse
from lmpress.quantize.targets import WeightQuantConfig
from lmpress.registry import StageContext, register_stage
from lmpress.weights.apply import apply_quantized_weight
from lmpress.weights.fp4 import Fp4Weight, quantize_weight_fp4
from lmpress.weights.scheme import QuantizedWeight, QuantScheme, compute_qparams, quantize_weight_rtn


class RTNConfig(WeightQuantConfig):
    method: Literal["rtn"] = "rtn"
    mse: bool = False

    @model_validator(mode="after")
    def _calibration_free(self) -> RTNConfig:
        for where, scheme in self.planned_schemes():
            if scheme.fp4 == "nvfp4" and scheme.activations == "fp4":
                raise ValueError(
                    f"{where.removeprefix('.') or 'activations'}: NVFP4 activations need each layer's static "
                    "input_global_scale from calibration data, which rtn does not read: use method gptq"
                )
            if self.mse and scheme.k_quant_scales:
                raise ValueError("mse: true with k_quant_scales: the k-quant grid fixes the scales; drop one")
        return self


def quantize_weight(w: torch.Tensor, scheme: QuantScheme, mse: bool) -> QuantizedWeight | Fp4Weight:
    """Round-to-nearest on the scheme's grid; ``mse`` searches the scales (FP4 block scales, integer ranges)."""
    if scheme.fp4 is not None:
        return quantize_weight_fp4(w, scheme, mse=mse)
    return quantize_weight_rtn(w, scheme, search_qparams_mse if mse else compute_qparams)


@register_stage("rtn", RTNConfig)
@torch.no_grad()
def run_rtn(model: nn.Module, config: RTNConfig, ctx: StageContext) -> dict:
    moe_blocks = unfuse_experts(model)  # fused MoE experts become one linear each, so every expert is quantized
    config.check(model)
    targets = config.targets(model)
    for name, (module, scheme) in ctx.bars.track(targets.items(), "rtn: layers", total=len(targets)):
        apply_quantized_weight(model, name, quantize_weight(module.weight.data, scheme, config.mse))
    return {"quantized_layers": len(targets), "moe_blocks_unfused": moe_blocks}
