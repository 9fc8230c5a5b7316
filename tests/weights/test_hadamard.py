import math

import pytest
import torch

from lmpress.weights.hadamard import (
    hadamard_matrix,
    hadamard_order_refusal,
    hadamard_sizes,
    hadamard_transform,
    random_hadamard,
)

# 12, 20, 44: Paley I; 28, 36: Paley II; 64: Sylvester; 576 = 16 x 36 and 1536 = 128 x 12 (SmolLM2's hidden and
# MLP widths); 896 = 32 x 28 (Qwen2-0.5B's hidden)
ORDERS = [1, 2, 12, 20, 24, 28, 36, 44, 60, 64, 576, 896, 1536]


@pytest.mark.parametrize("n", ORDERS)
def test_hadamard_matrix_is_an_orthogonal_plus_minus_one_matrix(n):
    h = hadamard_matrix(n)
    assert h.shape == (n, n) and h.dtype == torch.float64
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    # every entry +-1/sqrt(n): a Hadamard matrix, not merely an orthogonal one
    assert torch.allclose(h.abs(), torch.full_like(h, 1 / math.sqrt(n)), atol=1e-15)


def test_powers_of_two_are_sylvester_in_natural_order():
    n = 64
    i = torch.arange(n)
    popcount = torch.zeros(n, n, dtype=torch.int64)
    both = i[:, None] & i[None, :]
    for bit in range(6):
        popcount += (both >> bit) & 1
    expected = (1 - 2 * (popcount % 2)).double() / 8  # H[i, j] = (-1)^popcount(i & j) / sqrt(n)
    assert torch.equal(hadamard_matrix(n), expected)


def test_sizes_pick_the_smallest_base_order():
    assert hadamard_sizes(576) == (16, 36)
    assert hadamard_sizes(1536) == (128, 12)
    assert hadamard_sizes(14336) == (512, 28)  # Llama-3 8B's MLP width
    assert hadamard_sizes(4096) == (4096, 1)
    assert hadamard_sizes(5120) == (256, 20)
    assert hadamard_sizes(11008) is None  # 256 x 43; 172 = 4 x 43 needs Williamson's construction
    assert hadamard_sizes(100) is None


@pytest.mark.parametrize(
    "shape", [(5, 12), (7, 576), (2, 3, 1536), (4, 64), (3, 28), (1, 1, 896), (6, 2), (0, 36), (36,)]
)
def test_transform_equals_the_dense_matmul(shape):
    n = shape[-1]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(n))
    y = hadamard_transform(x, n)
    assert y.shape == x.shape and y.dtype == torch.float32
    expected = (x.double() @ hadamard_matrix(n).T).float()
    assert torch.allclose(y, expected, atol=1e-5, rtol=1e-5)
    assert torch.allclose(hadamard_transform(x.double(), n), x.double() @ hadamard_matrix(n).T, atol=1e-12)


def test_transform_is_its_own_inverse_for_symmetric_orders_and_keeps_norms():
    x = torch.randn(3, 64, dtype=torch.float64)
    assert torch.allclose(hadamard_transform(hadamard_transform(x, 64), 64), x, atol=1e-12)
    x = torch.randn(3, 576, dtype=torch.float64)
    assert torch.allclose(hadamard_transform(x, 576).norm(dim=-1), x.norm(dim=-1), atol=1e-10)


def test_random_hadamard_is_seeded_orthogonal_and_signed_columns():
    a, b, c = random_hadamard(576, 0), random_hadamard(576, 0), random_hadamard(576, 1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.allclose(a @ a.T, torch.eye(576, dtype=torch.float64), atol=1e-12)
    signs = (a / hadamard_matrix(576))[0]  # H @ diag(s): column j of H times s_j
    assert set(signs.round().tolist()) == {-1.0, 1.0}
    assert torch.allclose(a, hadamard_matrix(576) * signs[None, :])
    assert random_hadamard(64, 3, dtype=torch.float32).dtype == torch.float32


def test_refusal_names_the_order_its_factors_and_the_nearest_orders():
    assert hadamard_order_refusal(576) is None
    message = hadamard_order_refusal(11008)
    assert "order 11008 (= 256 x 43)" in message
    assert "the nearest orders that work are 10944 and 11072" in message
    assert hadamard_sizes(10944) and hadamard_sizes(11072)
    assert "\n" not in message
    assert "nearest orders that work are 96 and 104" in hadamard_order_refusal(100)
    with pytest.raises(ValueError, match="order 172 "):
        hadamard_matrix(172)
    with pytest.raises(ValueError, match="order 10 "):
        hadamard_transform(torch.zeros(2, 10), 10)
