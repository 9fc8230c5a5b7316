"""lmpress's GPTQ against a plain transcription of the paper's Algorithm 1, and against itself across block sizes.

Frantar et al., "GPTQ" (arXiv:2210.17323), Algorithm 1, written here column by column in float64 with no lazy
batching: H = 2XXᵀ, λ = damp · mean(diag H), the upper Cholesky factor U of (H + λI)⁻¹, and for each column i
q = quant(w_i), err = (w_i - q) / U_ii, W[:, i+1:] -= err · U_{i, i+1:}. Group scales are taken when a group
starts, from the weights as updated so far (the original weights with ``static_groups``); act-order permutes
the columns by descending diag(H) first. With k-quant scales, each 256-column super-block's d is taken when its
first column comes, from its columns as updated so far, and each group's scale is snapped to d's grid. Only the
scheme's one-group helpers (and the k-quant ones) come from lmpress.

lmpress runs in float32 with lazy block updates, so its rounding inputs w/scale differ from the float64 ones by
float error (this reference run in float32 instead differs by at most 1.2e-5 grid steps on this layer). That moves
a code only where w/scale sits within that distance of a rounding boundary. Such near ties are not rare by
accident: a symmetric grid maps a group's largest magnitude to exactly ±(2^bits - 1)/2, a tie whenever that weight
is the first one quantized in its group. Once a tie goes the other way, the rest of that row legitimately differs
(its error feeds the later columns). So codes must be identical everywhere except in a row after the reference
met a near tie (within ``TIE`` grid steps), and the weights compared that way must be nearly all of them.
"""

from __future__ import annotations

import pytest
import torch

from lmpress.quantize.gptq_quantize import gptq_quantize_layer
from lmpress.weights.kquant import SUPER_BLOCK, live_groups, snap_scales, snap_to_kquant_grid, super_scale
from lmpress.weights.scheme import QuantScheme, compute_qparams, dequantize_int, quantize_to_int
from tests.quantize.test_gptq_quantize import correlated_inputs

TIE = 1e-4  # grid steps: about 10x the largest float32 vs float64 difference of w/scale measured on this layer
DAMP = 0.01
DEAD = 7  # an input column that is always zero


def reference_gptq(W, H, scheme: QuantScheme, damp: float, act_order: bool, static_groups: bool) -> dict:
    """Algorithm 1 one column at a time, in float64; results in the original column order.

    ``tie[r, j]``: how close the reference's rounding input for weight (r, j) (and, for an asymmetric group's
    first column, its zero point) came to a rounding boundary, in grid steps.
    """
    W = W.double().clone()
    H = H.double().clone()
    rows, cols = W.shape
    width = scheme.group_width(cols)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    if static_groups:
        fixed = [compute_qparams(W[:, g : g + width], scheme) for g in range(0, cols, width)]
        if scheme.k_quant_scales:
            snapped = snap_to_kquant_grid(
                torch.stack([s for s, _ in fixed], dim=1), live_groups(W.reshape(rows, -1, width))
            )
            fixed = [(snapped[:, g], z) for g, (_, z) in enumerate(fixed)]
    order = torch.arange(cols)
    if act_order:
        order = torch.argsort(torch.diag(H), descending=True, stable=True)
        W, H = W[:, order], H[order][:, order]
    H = H + damp * torch.mean(torch.diag(H)) * torch.eye(cols, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    codes = torch.zeros(rows, cols)
    scales = torch.zeros(rows, cols // width, dtype=torch.float64)
    dequantized = torch.zeros(rows, cols, dtype=torch.float64)
    tie = torch.zeros(rows, cols, dtype=torch.float64)
    for i in range(cols):
        zero_tie = torch.full((rows,), 0.5, dtype=torch.float64)
        if static_groups:
            scale, zero = fixed[int(order[i]) // width]
        elif i % width == 0:
            if scheme.k_quant_scales and i % SUPER_BLOCK == 0:
                grouped = W[:, i : i + SUPER_BLOCK].reshape(rows, -1, width)
                block_scales, _ = compute_qparams(grouped, scheme)
                d = super_scale(torch.where(live_groups(grouped), block_scales, 0.0))
            scale, zero = compute_qparams(W[:, i : i + width], scheme)
            if scheme.k_quant_scales:
                zero_tie = distance_to_half(scale.double() / d.double())  # where round(s / d) changes its answer
                scale = snap_scales(scale, d)
            if not scheme.symmetric:
                wmin = W[:, i : i + width].amin(dim=1).clamp(max=0)
                zero_tie = distance_to_half(-wmin / scale.double())
        scales[:, int(order[i]) // width if static_groups else i // width] = scale.double()
        q = quantize_to_int(W[:, i], scale, zero, scheme.maxq)
        codes[:, i] = q
        dequantized[:, i] = dequantize_int(q, scale, zero).double()
        tie[:, i] = torch.minimum(distance_to_half(W[:, i] / scale.double()), zero_tie)
        err = (W[:, i] - dequantized[:, i]) / U[i, i]
        W[:, i + 1 :] -= err[:, None] * U[i, i + 1 :][None, :]
    back = torch.argsort(order)
    return {
        "codes": codes[:, back],
        "dequantized": dequantized[:, back],
        "tie": tie[:, back],
        "order": order,
        "scales": scales,
    }


def distance_to_half(x: torch.Tensor) -> torch.Tensor:
    """How far x is from the nearest k + 1/2, where round-to-nearest changes its answer."""
    return ((x - x.floor()) - 0.5).abs()


def comparable(reference: dict) -> torch.Tensor:
    """(rows, cols) mask of the weights quantized before the reference met a near tie in their row."""
    tie = reference["tie"][:, reference["order"]]  # processing order
    before_tie = (tie < TIE).int().cumsum(dim=1) == 0
    mask = torch.empty_like(before_tie)
    mask[:, reference["order"]] = before_tie
    return mask


@pytest.fixture(scope="module")
def layer():
    x = correlated_inputs(tokens=1024, cols=128, seed=3).double()
    x[:, DEAD] = 0
    H = 2 * x.T @ x / x.shape[0]  # the paper's H = 2XXᵀ, averaged over the tokens
    W = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)) * 0.05
    return W, H


SCHEMES = [QuantScheme(4, 32, True), QuantScheme(4, 32, False), QuantScheme(3, 32, False), QuantScheme(4, -1, True)]
ORDERS = [{}, {"act_order": True}, {"act_order": True, "static_groups": True}, {"static_groups": True}]


@pytest.mark.parametrize("options", ORDERS, ids=["natural", "act-order", "act-order-static", "static"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=QuantScheme.describe)
def test_gptq_matches_the_papers_algorithm(layer, scheme, options):
    W, H = layer
    options = {"act_order": False, "static_groups": False, **options}
    quantized, info = gptq_quantize_layer(W, H.float(), scheme, damp=DAMP, mse=False, **options)
    reference = reference_gptq(W, H, scheme, DAMP, **options)
    assert info == {"damp": DAMP, "dead_columns": 1}

    mask = comparable(reference)
    assert mask.float().mean() > 0.9, "too many near ties for this layer to say anything"
    codes = quantized.qweight.float()
    assert torch.equal(codes[mask], reference["codes"][mask]), int((codes != reference["codes"])[mask].sum())
    # float32 scales from float32 vs float64 updated weights: equal to a few float32 ulps
    torch.testing.assert_close(
        quantized.dequantize()[mask], reference["dequantized"][mask].float(), rtol=1e-5, atol=1e-7
    )
    assert torch.equal(codes[:, DEAD], reference["codes"][:, DEAD])
    assert torch.all(quantized.dequantize()[:, DEAD] == 0)


@pytest.mark.parametrize("options", ORDERS, ids=["natural", "act-order", "act-order-static", "static"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=QuantScheme.describe)
def test_lazy_block_updates_give_the_codes_of_column_by_column_updates(layer, scheme, options):
    """Block size 128 (the whole layer in one block), 48 (groups of 32 straddle blocks) and 1 (no lazy update)."""
    W, H = layer
    H = H.float()
    one, _ = gptq_quantize_layer(W, H, scheme, block_size=1, damp=DAMP, **options)
    mask = comparable(reference_gptq(W, H, scheme, DAMP, **{"act_order": False, "static_groups": False, **options}))
    assert mask.float().mean() > 0.9
    for block_size in (128, 48):
        blocked, _ = gptq_quantize_layer(W, H, scheme, block_size=block_size, damp=DAMP, **options)
        differ = blocked.qweight != one.qweight
        assert not differ[mask].any(), (block_size, int(differ.sum()))
        torch.testing.assert_close(blocked.scales[mask.all(dim=1)], one.scales[mask.all(dim=1)], rtol=1e-6, atol=0)
        assert torch.equal(blocked.zeros[mask.all(dim=1)], one.zeros[mask.all(dim=1)])
        assert (blocked.g_idx is None) == (one.g_idx is None)
        if one.g_idx is not None:
            assert torch.equal(blocked.g_idx, one.g_idx)


@pytest.fixture(scope="module")
def wide_layer():
    x = correlated_inputs(tokens=1024, cols=512, seed=7).double()
    x[:, DEAD] = 0
    H = 2 * x.T @ x / x.shape[0]
    W = torch.randn(48, 512, generator=torch.Generator().manual_seed(8)) * 0.05
    return W, H


KQUANT_ORDERS = [{}, {"act_order": True, "static_groups": True}, {"static_groups": True}]


@pytest.mark.parametrize("options", KQUANT_ORDERS, ids=["natural", "act-order-static", "static"])
def test_gptq_with_kquant_scales_matches_the_reference(wide_layer, options):
    """Block sizes 128 (super-blocks run past a block), 48 (a super-block starts mid-block) and 1."""
    W, H = wide_layer
    scheme = QuantScheme(4, 32, True, k_quant_scales=True)
    options = {"act_order": False, "static_groups": False, **options}
    reference = reference_gptq(W, H, scheme, DAMP, **options)
    mask = comparable(reference)
    assert mask.float().mean() > 0.9, "too many near ties for this layer to say anything"
    rows = mask.all(dim=1)
    for block_size in (128, 48, 1):
        quantized, _ = gptq_quantize_layer(W, H.float(), scheme, block_size=block_size, damp=DAMP, **options)
        codes = quantized.qweight.float()
        assert torch.equal(codes[mask], reference["codes"][mask]), (
            block_size,
            int((codes != reference["codes"])[mask].sum()),
        )
        torch.testing.assert_close(
            quantized.dequantize()[mask], reference["dequantized"][mask].float(), rtol=1e-5, atol=1e-7
        )
        assert rows.float().mean() > 0.3
        # a row without near ties took every d and every sc as the reference did: the same scales
        torch.testing.assert_close(quantized.scales[rows], reference["scales"][rows].float(), rtol=1e-6, atol=0)
