"""Orthonormal Hadamard matrices of the sizes models have (576, 640, 896, 3584, 4096, ...): a power of
two times a small factor, built as Sylvester's doubling of a Paley matrix (the construction QuaRot
and LinearPatch rely on; written here from the textbook definitions)."""

from __future__ import annotations

import functools

import torch

from blockfold.errors import BlockfoldError


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % p for p in range(2, int(n**0.5) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """``Q[i, j] = χ(j − i)``, χ the quadratic character of the integers modulo the prime ``q``."""
    residues = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in residues else -1.0 for a in range(1, q)], dtype=torch.float64)
    index = torch.arange(q)
    return chi[(index[None, :] - index[:, None]) % q]


def _paley(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``n`` (entries ±1) by Paley's first or second construction, or None."""
    if n == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if n == 2:
        return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    q = n - 1
    if _is_prime(q) and q % 4 == 3:  # Paley I: I + [[0, 1ᵀ], [−1, Q]]
        s = torch.zeros(n, n, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
        return torch.eye(n, dtype=torch.float64) + s
    q = n // 2 - 1
    if n % 2 == 0 and _is_prime(q) and q % 4 == 1:  # Paley II: from the symmetric conference matrix
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
        plus = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        minus = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, plus) + torch.kron(torch.eye(q + 1, dtype=torch.float64), minus)
    return None


@functools.lru_cache(maxsize=8)
def hadamard(size: int) -> torch.Tensor:
    """An orthonormal ``size × size`` Hadamard matrix (float64): ``H Hᵀ = I``, every entry ±1/√size."""
    odd, power = size, 0
    while odd % 2 == 0:
        odd, power = odd // 2, power + 1
    for doublings in range(power + 1):  # the smallest Paley factor odd · 2^j, then Sylvester's doubling
        base = _paley(odd * 2**doublings)
        if base is not None:
            sylvester = torch.ones(1, 1, dtype=torch.float64)
            for _ in range(power - doublings):
                sylvester = torch.kron(sylvester, torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
            return torch.kron(base, sylvester) / size**0.5
    raise BlockfoldError(f"no Hadamard matrix of order {size} is built here (a power of two times a Paley order): "
                         "use --patch full")
