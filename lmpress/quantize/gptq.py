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

FP4 (``fp4: nvfp4`` or ``mxfp4``; ``act_order`` with ``static_groups`` only, as FP4 blocks are contiguous):

    - method: gptq
      fp4: nvfp4
      activations: fp4       # W4A4: each layer's input_global_scale = 448 * 6 / max|X| over the calibration inputs
      mse: true              # block scales searched for the least squared error
      ignore: [lm_head]
      overrides:
        ".*down_proj": {fp4: int, bits: 8, group_size: 64}

W4A8 (integer weights, activations quantized to int8 per token at run time; compressed-tensors only):

    - method: rotate
      rotate_down_proj: true # R4: spreads down_proj's activation outliers before they meet int8
    - method: gptq
      bits: 4
      group_size: 64
      activations: int8
      mse: true

An NVFP4 W4A4 layer's static ``input_global_scale`` comes from the max |X| of its inputs, gathered with its
Hessian; that Hessian is of the inputs as they arrive, in float: the activations' own FP4 rounding is not in it
(nor in the inputs the calibration passes feed the next layers).

The math lives in ``gptq_quantize.py``; this module only reads each group's
Hessian from the calibration engine (``lmpress.calib``) and writes the result into
the model.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import nn

from lmpress.calib.engine import CalibrationMethod, run_one_shot_stage
from lmpress.calib.ranks import column_solve_cost, solve_across_ranks
from lmpress.calib.session import LayerSession
from lmpress.calib.statistics import HessianAccumulator, collect_inputs, group_hessians
from lmpress.quantize.gptq_quantize import gptq_quantize_layer
from lmpress.quantize.targets import GPTQRounding, needs_input_scale
from lmpress.registry import StageContext, register_stage
from lmpress.weights.fp4 import Fp4Weight, nvfp4_global_scale
from lmpress.weights.scheme import QuantizedWeight, QuantScheme

log = logging.getLogger(__name__)


class GPTQConfig(GPTQRounding):
    method: Literal["gptq"] = "gptq"

    @property
    def hessian_copies(self) -> int:
        """n x n float32 matrices the solve holds per linear: the stage's pass has no other method, so each
        Hessian's last linear factors it in place, except with act-order, which permutes it into a copy."""
        return 2 if self.act_order else 1


def scheme_of(target: QuantScheme | object) -> QuantScheme:
    """A linear's scheme: the target itself, or the ``scheme`` of a target that also prunes (SparseGPT + GPTQ)."""
    return target if isinstance(target, QuantScheme) else target.scheme


def gptq_group(
    session: LayerSession, names: list[str], config: GPTQRounding, warnings: list[str], last_reader: bool = False
) -> None:
    """GPTQ-quantize linears ``names`` of the session's layer on the group's shared Hessians.

    Entries an earlier method of the pass pruned (``session.masks``) stay zero. ``last_reader``: no later method
    of the pass reads the group's Hessians, so each is handed to its last linear, which factors in its storage.
    An NVFP4 W4A4 linear takes ``input_global_scale = 448 * 6 / max|X|`` (compressed-tensors' ``generate_gparam``)
    from the max its Hessian accumulator kept.
    """
    hessians = group_hessians(session, names)
    last_reader = last_reader and session.ranks == 1  # spread: a Hessian may be read by another rank's solve

    def solve(name: str) -> tuple[QuantizedWeight | Fp4Weight, dict]:
        accumulator = hessians[name]
        later = names[names.index(name) + 1 :]
        take = last_reader and all(hessians[n] is not accumulator for n in later)
        again = (lambda: collect_inputs(session, [name], HessianAccumulator)[name].H) if take else None
        quantized, info = gptq_quantize_layer(
            session.linear(name).weight.data,
            accumulator.take() if take else accumulator.H,
            scheme_of(session.targets[name]),
            block_size=config.block_size,
            damp=config.damp_percent,
            act_order=config.act_order,
            static_groups=config.static_groups,
            mse=config.mse,
            pruned=session.masks.get(name),
            hessian_again=again,
        )
        if isinstance(quantized, Fp4Weight) and needs_input_scale(quantized.scheme):
            quantized.input_global_scale = nvfp4_global_scale(accumulator.amax).cpu()
        return quantized, info

    if session.ranks == 1:  # solve and apply one linear at a time: one result held at once
        results = ((name, solve(name)) for name in names)
    else:  # each linear solved on one rank (a MoE expert's: where its Hessian is), the results broadcast
        cost = {n: column_solve_cost(session.linear(n).weight) for n in names}
        owners = session.expert_owners  # an expert's linears where its Hessian and stand-ins are
        results = iter(solve_across_ranks(names, cost.__getitem__, solve, session.ranks, owners).items())
    for name, (quantized, info) in results:
        if info["damp"] != config.damp_percent:
            message = f"{session.prefix}{name}: Hessian not positive definite, dampening raised to {info['damp']}"
            log.warning(message)
            warnings.append(message)
        session.apply(name, quantized)


class GPTQMethod(CalibrationMethod):
    name = "gptq"
    reduces_across_ranks = True

    def __init__(self, config: GPTQRounding, last_reader: bool = False) -> None:
        super().__init__()
        self.config = config
        self.last_reader = last_reader  # no later method of the pass reads the Hessians

    def process_group(self, session: LayerSession, group: list[str]) -> None:
        gptq_group(session, group, self.config, self.warnings, self.last_reader)


def calibration_method(config: GPTQRounding) -> GPTQMethod:
    """GPTQ rounding as one method of a pass that other stages compose (AWQ, SparseGPT + quantization)."""
    return GPTQMethod(config)


@register_stage("gptq", GPTQConfig)
@torch.no_grad()
def run_gptq(model: nn.Module, config: GPTQConfig, ctx: StageContext) -> dict:
    method = GPTQMethod(config, last_reader=True)  # the pass's only method
    return run_one_shot_stage(
        model, [config], [method], config.scheme_for, ctx, config.true_sequential, config.batch_size
    )
