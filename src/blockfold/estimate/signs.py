"""Fixing the sign of eigen- and singular vectors, which a decomposition returns only up to sign."""

from __future__ import annotations

import torch


def column_signs(matrix: torch.Tensor) -> torch.Tensor:
    """±1 per column of ``matrix``: the sign of its largest-magnitude entry (1 for a zero column). Multiplying
    the vectors (and their partners) by it makes runs on other hardware, or other LAPACK builds, agree."""
    signs = torch.sign(matrix.gather(0, matrix.abs().argmax(0, keepdim=True)))[0]
    return torch.where(signs == 0, torch.ones_like(signs), signs)
