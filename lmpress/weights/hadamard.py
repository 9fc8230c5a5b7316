"""Hadamard matrices and the fast Hadamard transform, for rotations (QuaRot, arXiv:2404.00456).

A Hadamard matrix of order n has entries +-1 and orthogonal rows; divided by sqrt(n) it is orthogonal.
lmpress builds the orders ``2^k * m`` for ``m`` a base order it can construct:

- ``m = 1``: Sylvester's construction, ``H_2n = [[H_n, H_n], [H_n, -H_n]]`` (every power of two);
- Paley construction I: ``m = p + 1`` for a prime ``p = 3 (mod 4)`` (12, 20, 24, 44, 48, 60, 68, ...);
- Paley construction II: ``m = 2 (p + 1)`` for a prime ``p = 1 (mod 4)`` (28, 36, 60, 108, ...);

combined by the Kronecker product ``H_m (x) H_2^k`` (the matrix :func:`hadamard_matrix` returns, and the one
:func:`hadamard_transform` applies). Orders such as 172 exist (Williamson's construction) but are not built
here; :func:`hadamard_order_refusal` says so and names the nearest orders that work.

Tensor math only (torch): the runtime imports this module for its online transforms.
"""

from __future__ import annotations

import math

import torch

# The largest base order m used: the transform's dense step costs m multiply-adds per element, so past this it
# is no longer the cheap op it is meant to be (and the matrix is m^2 entries).
MAX_BASE_ORDER = 1024


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _base_construction(m: int) -> str | None:
    """Which construction builds a Hadamard matrix of base order ``m`` ("sylvester", "paley1", "paley2"),
    or None."""
    if m in (1, 2):
        return "sylvester"
    if m % 4 or m > MAX_BASE_ORDER:
        return None
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return "paley1"
    if _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return "paley2"
    return None


def hadamard_sizes(n: int) -> tuple[int, int] | None:
    """``(2^k, m)`` with ``n = 2^k * m`` and ``m`` the smallest base order lmpress builds, or None when no such
    split exists (see :func:`hadamard_order_refusal`)."""
    if n < 1:
        return None
    odd = n
    while odd % 2 == 0:
        odd //= 2
    m = odd
    while n % m == 0:
        if _base_construction(m) is not None:
            return n // m, m
        m *= 2
    return None


def nearest_hadamard_orders(n: int) -> tuple[int | None, int]:
    """The largest order below ``n`` and the smallest above it that :func:`hadamard_sizes` can build (the one
    below is None when there is none)."""
    below = next((k for k in range(n - 1, 0, -1) if hadamard_sizes(k)), None)
    above = n + 1
    while hadamard_sizes(above) is None:
        above += 1
    return below, above


def hadamard_order_refusal(n: int) -> str | None:
    """Why no Hadamard matrix of order ``n`` can be built here (naming the order, its factors and the nearest
    orders that work), or None when one can."""
    if hadamard_sizes(n) is not None:
        return None
    if n < 1:
        return f"no Hadamard matrix of order {n}: an order is a positive integer"
    power, odd = 1, n
    while odd % 2 == 0:
        power, odd = power * 2, odd // 2
    below, above = nearest_hadamard_orders(n)
    nearest = f"{below} and {above}" if below else str(above)
    return (
        f"no Hadamard matrix of order {n} (= {power} x {odd}) can be built here: lmpress builds 2^k x m for m = 1 "
        f"(Sylvester), p + 1 for a prime p = 3 mod 4 (Paley I: 12, 20, 24, 44, ...) or 2(p + 1) for a prime "
        f"p = 1 mod 4 (Paley II: 28, 36, 60, ...), m <= {MAX_BASE_ORDER}, and no multiple 2^j x {odd} dividing {n} is "
        f"such an m; the nearest orders that work are {nearest}"
    )


def _legendre_table(p: int) -> list[int]:
    """chi(a) for a = 0..p-1: 0 for a = 0, 1 for a quadratic residue mod p, -1 otherwise."""
    residues = {(x * x) % p for x in range(1, p)}
    return [0] + [1 if a in residues else -1 for a in range(1, p)]


def _jacobsthal(p: int) -> torch.Tensor:
    chi = torch.tensor(_legendre_table(p), dtype=torch.float64)
    idx = torch.arange(p)
    return chi[(idx[None, :] - idx[:, None]) % p]  # Q[i, j] = chi(j - i)


# base order -> its +-1 matrix (float64, CPU); a plain dict, not functools.cache, which torch.compile does not
# look through (it would trace the construction into the graph)
_BASES: dict[int, torch.Tensor] = {}


def _base_matrix(m: int) -> torch.Tensor:
    """The unnormalized +-1 Hadamard matrix of base order ``m`` (float64, CPU; cached, never handed out)."""
    if m not in _BASES:
        _BASES[m] = _build_base(m)
    return _BASES[m]


def _build_base(m: int) -> torch.Tensor:
    kind = _base_construction(m)
    if kind == "sylvester":
        return torch.ones(1, 1, dtype=torch.float64) if m == 1 else torch.tensor([[1.0, 1.0], [1.0, -1.0]]).double()
    p = m - 1 if kind == "paley1" else m // 2 - 1
    q = _jacobsthal(p)
    ones = torch.ones(p, dtype=torch.float64)
    if kind == "paley1":
        # Q is skew-symmetric for p = 3 mod 4: H = I + [[0, 1^T], [-1, Q]] (a skew Hadamard matrix)
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = ones, -ones, q
        return torch.eye(m, dtype=torch.float64) + s
    # Q is symmetric for p = 1 mod 4: the conference matrix C = [[0, 1^T], [1, Q]] becomes a Hadamard matrix of
    # twice its order with each 0 -> [[1, -1], [-1, -1]] and each +-1 -> +-[[1, 1], [1, -1]]
    c = torch.zeros(p + 1, p + 1, dtype=torch.float64)
    c[0, 1:], c[1:, 0], c[1:, 1:] = ones, ones, q
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    zero_block = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, h2) + torch.kron(torch.eye(p + 1, dtype=torch.float64), zero_block)


def _sylvester(power: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    h2 = _base_matrix(2)
    while h.shape[0] < power:
        h = torch.kron(h2, h)
    return h


def _sizes_or_raise(n: int) -> tuple[int, int]:
    sizes = hadamard_sizes(n)
    if sizes is None:
        raise ValueError(hadamard_order_refusal(n))
    return sizes


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The normalized (orthogonal: ``H @ H.T = I``) Hadamard matrix ``(H_m (x) H_2^k) / sqrt(n)`` of order ``n``;
    ValueError for an order :func:`hadamard_sizes` cannot split."""
    power, m = _sizes_or_raise(n)
    h = torch.kron(_base_matrix(m), _sylvester(power))
    return (h / math.sqrt(n)).to(dtype)


def random_hadamard(n: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """QuaRot's randomized Hadamard matrix (section 4): ``H @ diag(s)`` with ``s`` random signs drawn from a
    ``torch.Generator`` seeded with ``seed``; orthogonal."""
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int64).to(torch.float64) * 2 - 1
    return (hadamard_matrix(n) * signs[None, :]).to(dtype)


def hadamard_transform(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x @ hadamard_matrix(n).T`` over the last dimension of ``x`` (of size ``n``), in ``x``'s dtype.

    With ``n = m * 2^k`` and the last dimension read as an ``(m, 2^k)`` matrix X, ``(H_m (x) H_2^k) x`` is
    ``H_m X H_2^k^T``: a Walsh-Hadamard butterfly (k stages of sums and differences) over the rows, then one
    ``m x m`` matmul. The loop runs over k, fixed by ``n``: no data-dependent control flow.
    """
    power, m = _sizes_or_raise(n)
    lead = x.shape[:-1]
    y = x.reshape(-1, m, power)
    h = 1
    while h < power:
        # pairs (i, i + h) within each block of 2h: (a, b) -> (a + b, a - b); blocks in order give Sylvester's
        # ordering H_2 (x) H_h
        y = y.reshape(-1, m, power // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    y = y.reshape(-1, m, power)
    if m > 1:
        y = torch.matmul(_base_matrix(m).to(device=x.device, dtype=x.dtype), y)
    return (y * (1.0 / math.sqrt(n))).reshape(*lead, n)
