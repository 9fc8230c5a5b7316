"""GPTQ's tensor math: quantize one linear layer's weight given its input Hessian.

Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization
for Generative Pre-trained Transformers" (ICLR 2023, arXiv:2210.17323).

For a linear layer with weight W (rows x cols) and calibration inputs X, GPTQ
minimises ||W X - Q X||² one column at a time (Eq. 1), using the Hessian of
that objective, H = 2 X Xᵀ. Quantizing column q with error (w_q - quant(w_q))
is compensated on the columns not yet quantized by the optimal update of
Optimal Brain Quantization (Eq. 2):

    δ_F = -(w_q - quant(w_q)) / [H_F⁻¹]_qq · (H_F⁻¹)_{:,q}

GPTQ takes the columns in a fixed order, so every H_F⁻¹ row it needs is a row of
the upper Cholesky factor of H⁻¹ (Eq. 4, "Cholesky reformulation"), and applies
the updates lazily: within a block of B columns immediately, to the columns
after the block once per block (Eq. 3, "lazy batch updates").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from lmpress.calib.statistics import column_loop_threads, inverse_hessian_factor
from lmpress.quantize.fp4_rounding import e2m1_rounder
from lmpress.quantize.mse_scales import search_qparams_mse
from lmpress.weights.float8 import Fp8Weight, fp8_channel_qparams, require_float8, round_to_e4m3_
from lmpress.weights.fp4 import Fp4Weight, fp4_block_scales, nvfp4_global_scale, round_to_e2m1
from lmpress.weights.kquant import GROUPS_PER_SUPER_BLOCK, SUPER_BLOCK, live_groups, snap_scales, snap_to_kquant_grid
from lmpress.weights.kquant import super_scale as kquant_super_scale
from lmpress.weights.scheme import QuantizedWeight, QuantScheme, compute_qparams

log = logging.getLogger(__name__)


def group_qparams(
    w: torch.Tensor, scheme: QuantScheme, mse: bool, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero of each row of ``w`` (one group per row). FP4: the block's stored scale (an E4M3 value under
    NVFP4's ``global_scale``, or a power of two) and a zero of 0, the E2M1 grid being symmetric about 0."""
    if scheme.fp4 is not None:
        scale = fp4_block_scales(w.float(), scheme.fp4, global_scale, mse)
        return scale, torch.zeros_like(scale)
    if scheme.activations == "fp8":
        return fp8_channel_qparams(w)
    return search_qparams_mse(w, scheme) if mse else compute_qparams(w, scheme)


def upcoming_columns(
    Wt: torch.Tensor,
    W1: torch.Tensor,
    Err1: torch.Tensor,
    Hinv: torch.Tensor,
    i1: int,
    col: int,
    n: int,
    keep_t: torch.Tensor | None,
) -> torch.Tensor:
    """The current (already error-compensated) weights of columns ``col .. col+n``, ``(n, rows)``, while
    the block starting at column ``i1`` (working copy ``W1``, errors so far ``Err1``) is being quantized.

    Columns past the block also need the updates this block's columns so far have not yet applied
    there (Eq. 3 runs at the block's end). Pruned entries (``keep_t`` False) will be zero: zero here too.
    """
    i, i2 = col - i1, i1 + W1.shape[0]
    current = W1[i : i + n]
    if col + n > i2:
        pending = Hinv[i1:col, i2 : col + n].T @ Err1[:i]
        current = torch.cat([current, Wt[i2 : col + n] - pending])
    if keep_t is not None:
        current = current * keep_t[col : col + n]
    return current


@torch.no_grad()
def gptq_quantize_layer(
    W: torch.Tensor,
    H: torch.Tensor,
    scheme: QuantScheme,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    static_groups: bool = False,
    mse: bool = False,
    pruned: torch.Tensor | None = None,
    hessian_again: Callable[[], torch.Tensor] | None = None,
) -> tuple[QuantizedWeight | Fp8Weight | Fp4Weight, dict]:
    """Quantize ``W`` (out, in) given ``H`` (in, in) = 2 X Xᵀ; returns the weight and ``{"damp", "dead_columns"}``.

    ``act_order`` takes columns by decreasing diag(H) (quantizing the columns with
    the largest activations first) and returns ``g_idx``; ``static_groups``
    computes every group's scale/zero from the original weights before any update,
    so groups stay contiguous in the original column order (no g_idx needed).
    ``pruned`` (bool, W's shape, True = pruned) keeps those entries at exactly zero:
    their code is their group's zero point, and the error of setting them to zero is
    compensated on the columns after them like any rounding error (SparseGPT's joint
    sparsification and quantization, Frantar & Alistarh 2023, §3.5).
    A scheme with FP8 activations (``activations: "fp8"``, per-channel) rounds each column to the
    nearest E4M3 value of ``w / s_row`` instead of an integer: GPTQ's update (Eq. 2) holds for any
    rounding grid; the result is an ``Fp8Weight``.
    An FP4 scheme (``scheme.fp4``) rounds each column to the nearest E2M1 value of ``w / s_block`` in the same
    way; NVFP4's per-tensor global scale is fixed up front from ``W``, each block's scale (``fp4_block_scales``,
    searched with ``mse``) is taken like an integer group's; the result is an ``Fp4Weight``. FP4 blocks are
    contiguous columns, so act-order needs ``static_groups`` there.

    With ``scheme.k_quant_scales`` each group's scale is snapped to ``d * round(s / d)``
    (``kquant.py``), ``d`` of each 256-column super-block taken when the loop reaches its first
    column, from the current weights of its columns (with static groups: from the original weights,
    up front, like the scales). Act-order without static groups cannot keep super-blocks contiguous.

    ``hessian_again`` hands ``H`` over: without act-order its inverse's factor is computed in ``H``'s own
    storage (H is overwritten), which saves an n x n float32 copy (0.8 GB for an 8B model's down_proj); should
    that factorization fail, ``hessian_again()`` gives H afresh for the retry with more dampening.
    """
    rows, cols = W.shape
    if not scheme.fits(cols):
        raise ValueError(scheme.misfit(cols))
    if H.shape != (cols, cols):
        raise ValueError(f"Hessian shape {tuple(H.shape)} does not match a weight with {cols} input columns")
    # The float32 working copy, made once and column-major (column j of W is row j of Wt, so each step of the
    # loop reads contiguous memory): W is its transposed view until act-order permutes it into a copy.
    Wt = torch.empty((cols, rows), dtype=torch.float32, device=W.device)
    Wt.copy_(W.detach().T)
    W = Wt.T
    H = H.detach()
    width = scheme.group_width(cols)
    maxq = scheme.maxq
    fp8 = scheme.activations == "fp8"
    if fp8 and width != cols:
        raise ValueError(f"FP8 weights take one scale per output channel (group_size -1), not groups of {width}")
    kquant = scheme.k_quant_scales
    fp4 = scheme.fp4 is not None

    # Inputs that were always zero carry no information: fix their weights at 0 and
    # give H a unit diagonal there so it stays invertible.
    dead = torch.diag(H) == 0
    W[:, dead] = 0
    keep = None
    if pruned is not None:
        if pruned.shape != W.shape:
            raise ValueError(f"pruning mask {tuple(pruned.shape)} does not match the weight {tuple(W.shape)}")
        keep = ~pruned.to(W.device, torch.bool)
        W.mul_(keep)

    n_groups = cols // width
    scales = torch.zeros(rows, n_groups, device=W.device)
    zeros = torch.zeros(rows, n_groups, device=W.device)
    static = static_groups or width == cols  # group parameters fixed up front, from the original weights
    if kquant and act_order and not static:
        raise ValueError("k-quant scales need contiguous groups: act_order needs static_groups")
    if fp4 and act_order and not static:
        raise ValueError("FP4 blocks are contiguous columns: act_order needs static_groups")
    global_scale = nvfp4_global_scale(W) if scheme.fp4 == "nvfp4" else None
    if static:
        for g in range(n_groups):
            scales[:, g], zeros[:, g] = group_qparams(W[:, g * width : (g + 1) * width], scheme, mse, global_scale)
        if kquant:
            scales = snap_to_kquant_grid(scales, live_groups(W.reshape(rows, n_groups, width)))

    perm = torch.arange(cols, device=W.device)
    if act_order:
        perm = torch.argsort(torch.diag(H).float().masked_fill(dead, 1), descending=True, stable=True)
        W = W[:, perm]
        if keep is not None:
            keep = keep[:, perm]

    in_place = [hessian_again is not None and not act_order and H.dtype == torch.float32 and H.is_contiguous()]
    retried = [False]

    def working_hessian() -> torch.Tensor:
        if in_place[0]:
            in_place[0], retried[0] = False, True
            work = H  # overwritten: the caller handed it over
        elif retried[0]:
            work = hessian_again().float().contiguous()  # H itself was factored by the failed try
        else:
            work = H.float()[perm][:, perm] if act_order else H.float().clone()
        unused = dead[perm]
        work[unused, unused] = 1
        return work

    Hinv, used_damp = inverse_hessian_factor(working_hessian, damp)
    Wt = W.T.contiguous()  # Wt itself unless act-order permuted W
    del W
    # Codes as they are found: integers as uint8, FP8 and FP4 values in bfloat16 (exact for E4M3 and E2M1); a
    # float32 row is the loop's workspace (an 8B model's down_proj: 59 MB of codes where float32 took 235 MB).
    codes_t = torch.zeros(cols, rows, dtype=torch.bfloat16 if fp8 or fp4 else torch.uint8, device=Wt.device)
    q = torch.empty(rows, device=Wt.device)
    keep_t = None if keep is None else keep.T.contiguous()
    column_group = (perm // width).tolist() if static else None
    scale_g = zero_g = super_d = None
    current_group = -1
    threads = torch.get_num_threads()
    round_e2m1_ = e2m1_rounder(Wt.device) if fp4 else None
    with column_loop_threads(1):
        for i1 in range(0, cols, block_size):
            i2 = min(i1 + block_size, cols)
            W1 = Wt[i1:i2].clone()
            Err1 = torch.empty_like(W1)
            Hinv1 = Hinv[i1:i2, i1:i2].contiguous()  # Hinv is column-major: the loop reads rows
            diagonal = Hinv1.diagonal().tolist()
            # Row views made once per block: the loop body is a few tiny ops per column.
            for i, (w, code, err, hinv_row) in enumerate(zip(W1, codes_t[i1:i2], Err1, Hinv1, strict=True)):
                col = i1 + i
                if static:
                    g = column_group[col]
                else:
                    g = col // width
                    if col % width == 0:  # group parameters from the current, error-compensated weights
                        current = upcoming_columns(Wt, W1, Err1, Hinv, i1, col, width, keep_t)
                        # an integer scale search is one large tensor op (threads help); FP4's is a few dozen
                        # small ones over (rows, 16), where a second thread's parallel regions cost more than
                        # they save (waiting on a descheduled worker when the machine is busy: 70x torch.round)
                        with column_loop_threads(1 if fp4 else threads):
                            if kquant and col % SUPER_BLOCK == 0:
                                sb = upcoming_columns(Wt, W1, Err1, Hinv, i1, col, SUPER_BLOCK, keep_t)
                                grouped = sb.T.reshape(rows, GROUPS_PER_SUPER_BLOCK, width)
                                block_scales, _ = group_qparams(grouped, scheme, mse)
                                live = live_groups(grouped)
                                super_d = kquant_super_scale(torch.where(live, block_scales, 0.0))
                            scales[:, g], zeros[:, g] = group_qparams(current.T, scheme, mse, global_scale)
                            if kquant:
                                scales[:, g] = snap_scales(scales[:, g], super_d)
                if g != current_group:
                    scale_g, zero_g, current_group = scales[:, g].contiguous(), zeros[:, g].contiguous(), g
                    if global_scale is not None:
                        scale_g = scale_g / global_scale  # NVFP4: w = e2m1 * scale / global_scale
                torch.div(w, scale_g, out=q)
                if fp8:
                    round_to_e4m3_(q)  # zero is 0: the code is the E4M3 value itself
                elif fp4:
                    round_e2m1_(q)  # zero is 0: the E2M1 value is the code
                else:
                    q.round_().add_(zero_g).clamp_(0, maxq)
                if keep_t is not None:
                    q.copy_(torch.where(keep_t[col], q, zero_g))
                code.copy_(q)
                # (w - dequantized) / [H_F⁻¹]_qq, written as (dequantized - w) / -[H_F⁻¹]_qq
                torch.sub(q, zero_g, out=err).mul_(scale_g).sub_(w).div_(-diagonal[i])
                # Eq. 2 restricted to the block: update the block's remaining columns now.
                W1[i + 1 :].addr_(hinv_row[i + 1 :], err, alpha=-1)
            # Eq. 3: one batched update of every column after the block.
            Wt[i2:].addmm_(Hinv[i1:i2, i2:].T, Err1, alpha=-1)
    codes = codes_t.T
    g_idx = None
    if act_order:
        invperm = torch.argsort(perm)
        codes = codes[:, invperm]
        if not static:
            g_idx = (torch.arange(cols, device=codes.device) // width)[invperm].to(torch.int32).cpu()
    info = {"damp": used_damp, "dead_columns": int(dead.sum())}
    if fp8:
        return Fp8Weight(codes.to(require_float8("gptq")).contiguous().cpu(), scales.cpu(), "channel"), info
    if fp4:
        codes = round_to_e2m1(codes.float())  # the E2M1 values found, as codes (exact: they are on the grid)
        gs = None if global_scale is None else global_scale.cpu()
        return Fp4Weight(codes.contiguous().cpu(), scales.cpu(), scheme, gs), info
    quantized = QuantizedWeight(
        qweight=codes.to(torch.uint8).contiguous().cpu(),
        scales=scales.cpu(),
        zeros=zeros.cpu(),
        scheme=scheme,
        g_idx=g_idx,
    )
    return quantized, info


def layer_output_error(W: torch.Tensor, W_hat: torch.Tensor, X: torch.Tensor) -> float:
    """Mean squared error of the layer outputs ||X Wᵀ - X Ŵᵀ||² / numel on inputs ``X`` (tokens, in)."""
    return torch.mean((X.float() @ (W.float() - W_hat.float()).T) ** 2).item()
