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
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lmpress.quantize.scheme import QuantizedWeight, QuantScheme, compute_qparams

log = logging.getLogger(__name__)

MSE_GRID = 100
MSE_MAX_SHRINK = 0.8
MSE_NORM = 2.4
MSE_CHUNK = 8
MAX_DAMP = 1.0
GRAM_BLOCK = 256


class HessianAccumulator:
    """Running mean of 2 x xᵀ over every token seen: H = 2/n Σ x xᵀ (float32)."""

    def __init__(self, columns: int, device: torch.device | str = "cpu") -> None:
        self.H = torch.zeros(columns, columns, dtype=torch.float32, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        m = x.shape[0]
        if m == 0:
            return
        self.H *= self.n / (self.n + m)
        self.n += m
        x = x * math.sqrt(2 / self.n)
        add_gram(self.H, x)


def add_gram(H: torch.Tensor, x: torch.Tensor, block: int = GRAM_BLOCK) -> None:
    """H += xᵀx computing only the blocks on and above the diagonal (xᵀx is symmetric), then mirroring."""
    cols = x.shape[1]
    for i in range(0, cols, block):
        j = min(i + block, cols)
        strip = x[:, i:j].T @ x[:, i:]  # rows i:j, columns i:
        H[i:j, i:] += strip
        H[j:, i:j] += strip[:, j - i :].T


def search_qparams_mse(
    w: torch.Tensor,
    scheme: QuantScheme,
    grid: int = MSE_GRID,
    max_shrink: float = MSE_MAX_SHRINK,
    norm: float = MSE_NORM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero per row of ``w`` minimising Σ|w - fake_quant(w)|^norm over shrunk min/max ranges.

    The grid of range shrink factors 1, 1 - 1/grid, ... down to 1 - max_shrink and
    the norm 2.4 follow the reference GPTQ implementation's ``mse`` option.
    """
    w = w.float()
    candidates = 1 - torch.arange(int(max_shrink * grid), device=w.device, dtype=torch.float32) / grid
    best_err = best_scale = best_zero = None
    # A few shrink factors at a time bounds the (n_shrink, *w.shape) buffer's memory; strict "<" across
    # chunks and argmin's first index within one keep the first minimum, as one search over all would.
    for shrinks in candidates.split(MSE_CHUNK):
        shrinks = shrinks.reshape(-1, *([1] * (w.dim() - 1)))
        scale, zero = compute_qparams(w, scheme, shrinks)
        scale_, zero_ = scale[..., None], zero[..., None]
        # fake_quantize(w) - w, computed in place on one buffer
        err = torch.div(w[None], scale_).round_().add_(zero_).clamp_(0, scheme.maxq).sub_(zero_).mul_(scale_)
        err = err.sub_(w[None]).abs_().pow_(norm).sum(-1)
        err, best = err.min(dim=0, keepdim=True)
        scale, zero = scale.gather(0, best)[0], zero.gather(0, best)[0]
        if best_err is None:
            best_err, best_scale, best_zero = err[0], scale, zero
            continue
        better = err[0] < best_err
        best_err = torch.where(better, err[0], best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def group_qparams(w: torch.Tensor, scheme: QuantScheme, mse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return search_qparams_mse(w, scheme) if mse else compute_qparams(w, scheme)


def inverse_hessian_factor(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + λI)⁻¹ with λ = damp · mean(diag H) (Eq. 4 and §4 "Cholesky reformulation").

    When the factorization fails, λ is raised tenfold (up to ``MAX_DAMP``) and the
    damp that worked is returned so the caller can report it.
    """
    mean_diag = torch.mean(torch.diag(H)).item()
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    while True:
        L, info = torch.linalg.cholesky_ex(H + damp * mean_diag * eye)
        if info.item() == 0:
            Hinv = torch.cholesky_solve(eye, L)  # (H + λI)⁻¹; several times faster than cholesky_inverse on CPU
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if info.item() == 0 and torch.isfinite(U).all():
                return U, damp
        if damp >= MAX_DAMP:
            raise RuntimeError(f"the Hessian is not positive definite even with dampening {damp}")
        damp = min(damp * 10, MAX_DAMP)


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
) -> tuple[QuantizedWeight, dict]:
    """Quantize ``W`` (out, in) given ``H`` (in, in) = 2 X Xᵀ; returns the weight and ``{"damp", "dead_columns"}``.

    ``act_order`` takes columns by decreasing diag(H) (quantizing the columns with
    the largest activations first) and returns ``g_idx``; ``static_groups``
    computes every group's scale/zero from the original weights before any update,
    so groups stay contiguous in the original column order (no g_idx needed).
    """
    rows, cols = W.shape
    if not scheme.fits(cols):
        raise ValueError(f"group size {scheme.group_size} does not divide in_features {cols}")
    if H.shape != (cols, cols):
        raise ValueError(f"Hessian shape {tuple(H.shape)} does not match a weight with {cols} input columns")
    W = W.detach().float().clone()
    H = H.detach().float().clone()
    width = scheme.group_width(cols)
    maxq = scheme.maxq

    # Inputs that were always zero carry no information: fix their weights at 0 and
    # give H a unit diagonal there so it stays invertible.
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    n_groups = cols // width
    scales = torch.zeros(rows, n_groups, device=W.device)
    zeros = torch.zeros(rows, n_groups, device=W.device)
    if static_groups or width == cols:
        for g in range(n_groups):
            scales[:, g], zeros[:, g] = group_qparams(W[:, g * width : (g + 1) * width], scheme, mse)

    perm = torch.arange(cols, device=W.device)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        W = W[:, perm]
        H = H[perm][:, perm]

    Hinv, used_damp = inverse_hessian_factor(H, damp)
    del H
    # Column-major working copies: column j of W is row j of Wt, so each step reads contiguous memory.
    Wt = W.T.contiguous()
    del W
    codes_t = torch.zeros(cols, rows, dtype=torch.uint8, device=Wt.device)
    scale_g = zero_g = None
    current_group = -1
    threads = torch.get_num_threads()
    with _threads(1):
        for i1 in range(0, cols, block_size):
            i2 = min(i1 + block_size, cols)
            W1 = Wt[i1:i2].clone()
            Err1 = torch.zeros_like(W1)
            Hinv1 = Hinv[i1:i2, i1:i2]
            for i in range(i2 - i1):
                col = i1 + i
                if static_groups or width == cols:
                    g = perm[col].item() // width
                else:
                    g = col // width
                    if col % width == 0:
                        # Group parameters from the current (already error-compensated) weights.
                        current = torch.cat([W1[i:], Wt[i2:]])[:width]
                        with _threads(threads):  # the scale search is one large tensor op
                            scales[:, g], zeros[:, g] = group_qparams(current.T, scheme, mse)
                if g != current_group:
                    scale_g, zero_g, current_group = scales[:, g].contiguous(), zeros[:, g].contiguous(), g
                w = W1[i]
                q = torch.div(w, scale_g).round_().add_(zero_g).clamp_(0, maxq)
                codes_t[col] = q.to(torch.uint8)
                err = q.sub_(zero_g).mul_(scale_g).neg_().add_(w).div_(Hinv1[i, i])
                # Eq. 2 restricted to the block: update the block's remaining columns now.
                W1[i:].addr_(Hinv1[i, i:], err, alpha=-1)
                Err1[i] = err
            # Eq. 3: one batched update of every column after the block.
            Wt[i2:].addmm_(Hinv[i1:i2, i2:].T, Err1, alpha=-1)
    codes = codes_t.T

    g_idx = None
    if act_order:
        invperm = torch.argsort(perm)
        codes = codes[:, invperm]
        if not static_groups and width != cols:
            g_idx = (torch.arange(cols, device=codes.device) // width)[invperm].to(torch.int32)
    quantized = QuantizedWeight(
        qweight=codes.contiguous().cpu(), scales=scales.cpu(), zeros=zeros.cpu(), scheme=scheme, g_idx=g_idx
    )
    if g_idx is not None:
        quantized.g_idx = g_idx.cpu()
    return quantized, {"damp": used_damp, "dead_columns": int(dead.sum())}


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run with ``n`` threads: GPTQ's column loop is thousands of tiny vector ops (one thread), its
    group scale search one large tensor op (all threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def layer_output_error(W: torch.Tensor, W_hat: torch.Tensor, X: torch.Tensor) -> float:
    """Mean squared error of the layer outputs ||X Wᵀ - X Ŵᵀ||² / numel on inputs ``X`` (tokens, in)."""
    return torch.mean((X.float() @ (W.float() - W_hat.float()).T) ** 2).item()
