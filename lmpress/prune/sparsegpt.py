"""SparseGPT (Frantar & Alistarh 2023, "SparseGPT: Massive Language Models Can Be Accurately Pruned in One-Shot").

Sample recipe stages:

    - method: sparsegpt
      sparsity: 0.5              # fraction of each linear's weights set to zero
      pattern: unstructured      # or 2:4, 4:8
      block_size: 128            # lazy-update block B_s, also the adaptive mask-selection block
      damp_percent: 0.01         # dampening λ, relative to the mean Hessian diagonal
      reconstruct: true          # re-solve the kept weights exactly for the final mask (prune/reconstruct.py)
      true_sequential: true
      ignore: []
      overrides:
        ".*self_attn.*": {sparsity: 0.4}

    - method: sparsegpt         # 2:4 and 4-bit weights in one pass (§3.5, joint sparsification and quantization)
      pattern: "2:4"
      quantize: {bits: 4, group_size: 64, symmetric: true}

For a linear with weight W and inputs X, SparseGPT minimises ||W X - Ŵ X||² over
masked Ŵ (Eq. 1) with the Hessian H = 2 X Xᵀ the calibration engine accumulates
(``calib.statistics``, shared with GPTQ). Columns are visited left to right; the
mask of each block of B_s columns is chosen when the block starts by the OBS
saliency w² / [H⁻¹]²_cc (Eq. 3, "adaptive mask selection"; with N:M, within each
group of M columns of a row), a pruned weight is set to zero and its error
compensated on the row's later columns by the OBS update
δ = -w_c / [H⁻¹]_cc · (H⁻¹)_{c,:} (Eq. 2), all of it on the rows of the upper
Cholesky factor of (H + λI)⁻¹ (Algorithm 1), with updates after the block applied
once per block (lazy batch updates).

With ``reconstruct`` (the default), the kept weights of each row are then solved
exactly for the mask SparseGPT chose (``prune.reconstruct``: the least-squares
optimum that the column loop's one-directional updates approximate); on SmolLM2-135M
at 2:4 this lowers each linear's output error by 15-30%. ``reconstruct: false`` is the
paper's algorithm as published.

With ``quantize``, the same pass then runs GPTQ's rounding on each group, on the
same Hessian, with the pruned weights held at zero (their codes are their group's
zero point) and the rounding errors compensated only through the kept weights.
"""

from __future__ import annotations

import logging
import re
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from lmpress.calib.engine import CalibrationMethod, run_one_shot_stage
from lmpress.calib.ranks import column_solve_cost, solve_across_ranks
from lmpress.calib.session import LayerSession
from lmpress.calib.statistics import column_loop_threads, group_hessians, inverse_hessian_factor
from lmpress.prune.masks import nm_mask
from lmpress.prune.reconstruct import masked_least_squares
from lmpress.prune.targets import PruneConfig, PruneTarget
from lmpress.quantize.targets import Bits, GroupSize
from lmpress.registry import StageContext, StrictConfig, calibration_method, register_stage, stage_config
from lmpress.weights.scheme import QuantScheme

log = logging.getLogger(__name__)


class JointQuantization(StrictConfig):
    """GPTQ rounding in the same pass, pruned weights kept at zero."""

    bits: Bits = 4
    group_size: GroupSize = 64
    symmetric: bool = True
    act_order: bool = False
    static_groups: bool = False
    mse: bool = False


class SparseGPTConfig(PruneConfig):
    method: Literal["sparsegpt"] = "sparsegpt"
    calibrates_layerwise: ClassVar[bool] = True
    spreads_across_processes: ClassVar[bool] = True
    block_size: int = Field(128, ge=1, le=4096)
    damp_percent: float = Field(0.01, gt=0, le=1)
    reconstruct: bool = Field(True, description="re-solve the kept weights exactly for the final mask")
    true_sequential: bool = True
    batch_size: int = Field(4, ge=1, description="calibration samples per forward pass")
    quantize: JointQuantization | None = None
    gathers_hessians: ClassVar[bool] = True  # type: ignore[assignment]

    @model_validator(mode="after")
    def _blocks_hold_whole_nm_groups(self) -> SparseGPTConfig:
        patterns = [self.pattern, *(o.pattern for o in self.overrides.values() if o.pattern)]
        for pattern in patterns:
            if pattern != "unstructured" and self.block_size % int(pattern.split(":")[1]):
                raise ValueError(f"block_size {self.block_size} is not a multiple of M in pattern {pattern}")
        return self

    def scheme(self) -> QuantScheme | None:
        q = self.quantize
        return None if q is None else QuantScheme(q.bits, q.group_size, q.symmetric)

    def target_for(self, name: str) -> PruneTarget | None:
        target = super().target_for(name)
        scheme = self.scheme()
        if scheme is None or any(re.fullmatch(p, name) for p in self.ignore):
            return target
        # a linear left dense is still quantized
        target = target or PruneTarget(0.0)
        return PruneTarget(target.sparsity, target.n, target.m, scheme)

    def planned_schemes(self) -> list[tuple[str, QuantScheme]]:
        """The quantization scheme this stage writes (for the export checks), none without ``quantize``."""
        scheme = self.scheme()
        return [] if scheme is None else [(".quantize", scheme)]

    def quantized_linears(self, model: nn.Module) -> dict[str, tuple[nn.Linear, QuantScheme]]:
        """What a GPTQ stage of the joint quantization's settings would quantize (``rounding``), none without it."""
        return {} if self.quantize is None else self.rounding().quantized_linears(model)

    def rounding(self) -> object:
        """The GPTQ stage config of the joint quantization (same Hessian dampening, block and batches)."""
        q = self.quantize
        return stage_config("gptq")(
            **q.model_dump(),
            damp_percent=self.damp_percent,
            block_size=self.block_size,
            true_sequential=self.true_sequential,
            batch_size=self.batch_size,
            ignore=self.ignore,
        )


@torch.no_grad()
def sparsegpt_prune_layer(
    W: torch.Tensor,
    H: torch.Tensor,
    target: PruneTarget,
    block_size: int = 128,
    damp: float = 0.01,
    reconstruct: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Prune ``W`` (out, in) given ``H`` (in, in) = 2 X Xᵀ; returns the pruned weight (W's dtype), its mask
    (True = pruned) and ``{"damp", "dead_columns"}``. With ``reconstruct`` the kept weights are finally solved
    exactly for the mask (``masked_least_squares``) on the same damped Hessian."""
    rows, cols = W.shape
    if H.shape != (cols, cols):
        raise ValueError(f"Hessian shape {tuple(H.shape)} does not match a weight with {cols} input columns")
    if target.structured_nm and cols % target.m:
        raise ValueError(f"M={target.m} does not divide in_features {cols}")
    dtype = W.dtype
    W, H, dead = without_dead_columns(W, H)
    Hinv, used_damp = inverse_hessian_factor(H.clone, damp)
    if reconstruct:
        W_original = W.clone()
        damp_hessian_(H, used_damp)
    else:
        del H
    # Column-major working copies (column c of W is row c of Wt): each step reads contiguous memory.
    Wt = W.T.contiguous()
    del W
    pruned_t = torch.zeros(cols, rows, dtype=torch.bool, device=Wt.device)
    with column_loop_threads(1):
        for i1 in range(0, cols, block_size):
            i2 = min(i1 + block_size, cols)
            W1 = Wt[i1:i2]  # a view: the block is rewritten in place
            Err1 = torch.zeros_like(W1)
            Hinv1 = Hinv[i1:i2, i1:i2].contiguous()  # Hinv is column-major: the loop reads rows
            diagonal = Hinv1.diagonal()
            if not target.structured_nm:
                # Eq. 3 on the whole block: the lowest w² / [H⁻¹]²_cc are pruned (adaptive mask selection).
                saliency = W1.square() / diagonal.square().reshape(-1, 1)
                k = int(saliency.numel() * target.sparsity)
                if k:
                    flat = pruned_t[i1:i2].view(-1)
                    flat[torch.topk(saliency.flatten(), k, largest=False).indices] = True
            d = diagonal.tolist()
            for i in range(i2 - i1):
                if target.structured_nm and i % target.m == 0:
                    # N:M: the saliency of the next M columns, taken now (after the updates so far), per row
                    span = slice(i, i + target.m)
                    saliency = W1[span].square() / diagonal[span].square().reshape(-1, 1)
                    pruned_t[i1 + i : i1 + i + target.m] = nm_mask(saliency.T, target.n, target.m).T
                w = W1[i]
                # err = (w - ŵ) / [H⁻¹]_cc with ŵ = 0 where pruned, w elsewhere (Eq. 2 numerator)
                err = Err1[i]
                torch.mul(w, pruned_t[i1 + i], out=err).div_(d[i])
                w.masked_fill_(pruned_t[i1 + i], 0)
                # Eq. 2 restricted to the block: update the block's later columns now.
                W1[i + 1 :].addr_(Hinv1[i, i + 1 :], err, alpha=-1)
            # Lazy batch update of every column after the block.
            Wt[i2:].addmm_(Hinv[i1:i2, i2:].T, Err1, alpha=-1)
    pruned = pruned_t.T.contiguous() | dead.reshape(1, -1)
    if reconstruct:
        W = masked_least_squares(W_original, H, pruned).to(dtype)
    else:
        W = Wt.T.masked_fill(pruned, 0).contiguous().to(dtype)
    return W, pruned, {"damp": used_damp, "dead_columns": int(dead.sum())}


def without_dead_columns(W: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 copies of ``W`` and ``H`` where inputs that were always zero (no information) lose their weights and
    get a unit diagonal (H stays invertible), and the mask of those columns."""
    W = W.detach().float().clone()
    H = H.detach().float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    return W, H, dead


def damp_hessian_(H: torch.Tensor, damp: float) -> None:
    """``H + damp * mean(diag H) * I`` in place: the damped Hessian the column loop's factor inverts."""
    H.diagonal().add_(damp * torch.mean(torch.diag(H)))


def reconstruct_across_ranks(W: torch.Tensor, H: torch.Tensor, pruned: torch.Tensor, used_damp: float) -> torch.Tensor:
    """``masked_least_squares`` of ``W`` for the mask ``pruned`` with every process solving its share of the rows
    (``part``), gathered: the weights one process would solve, bit for bit, in ``W``'s dtype."""
    import torch.distributed as dist

    from lmpress.calib.ranks import all_gather_objects
    from lmpress.prune.reconstruct import solved_rows

    dtype = W.dtype
    W, H, _ = without_dead_columns(W, H)
    damp_hessian_(H, used_damp)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [solved_rows(pruned, (r, world)) for r in range(world)]
    mine = masked_least_squares(W, H, pruned, (rank, world))
    out = torch.zeros_like(mine)
    for r, solved in enumerate(all_gather_objects(mine[rows[rank]].cpu())):
        out[rows[r]] = solved.to(out.device)
    return out.masked_fill(pruned, 0).to(dtype)


class SparseGPTMethod(CalibrationMethod):
    name = "sparsegpt"
    reduces_across_ranks = True

    def __init__(self, config: SparseGPTConfig) -> None:
        super().__init__()
        self.config = config

    def process_group(self, session: LayerSession, group: list[str]) -> None:
        hessians = group_hessians(session, group)
        names = [name for name in group if session.targets[name].sparsity > 0]

        spread = session.ranks > 1
        # Spread, each mask is chosen on one rank and its exact reconstruction shared out by rows afterwards.
        reconstruct_here = self.config.reconstruct and not spread

        def solve(name: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
            alone = name in session.hessian_owners  # only this rank holds its Hessian (a MoE expert's)
            weight, pruned, info = sparsegpt_prune_layer(
                session.linear(name).weight.data,
                hessians[name].H,
                session.targets[name],
                block_size=self.config.block_size,
                damp=self.config.damp_percent,
                reconstruct=reconstruct_here or (self.config.reconstruct and alone),
            )
            shared_out = self.config.reconstruct and spread and not alone
            return (None if shared_out else weight), pruned, info  # shared out: the mask alone

        if not spread:  # solve and set one linear at a time: one result held at once
            results = ((name, solve(name)) for name in names)
        else:  # each linear's columns on one rank, the results broadcast (lmpress.calib.ranks)
            cost = {n: column_solve_cost(session.linear(n).weight) for n in names}
            owners = session.expert_owners  # an expert's linears where its Hessian and stand-ins are
            results = iter(solve_across_ranks(names, cost.__getitem__, solve, session.ranks, owners).items())
        for name, (weight, pruned, info) in results:
            if weight is None:  # every rank solves a share of the rows for the mask
                original = session.linear(name).weight.data
                weight = reconstruct_across_ranks(original, hessians[name].H, pruned.to(original.device), info["damp"])
            if info["damp"] != self.config.damp_percent:
                message = f"{session.prefix}{name}: Hessian not positive definite, dampening raised to {info['damp']}"
                log.warning(message)
                self.warnings.append(message)
            session.set_weight(name, weight.to(session.device), pruned.to(session.device))


@register_stage("sparsegpt", SparseGPTConfig)
@torch.no_grad()
def run_sparsegpt(model: nn.Module, config: SparseGPTConfig, ctx: StageContext) -> dict:
    configs, methods = [config], [SparseGPTMethod(config)]
    if config.quantize is not None:
        rounding = config.rounding()
        configs.append(rounding)
        methods.append(calibration_method("gptq", rounding))
    return run_one_shot_stage(
        model, configs, methods, config.target_for, ctx, config.true_sequential, config.batch_size
    )
