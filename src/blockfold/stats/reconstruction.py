"""Normal equations of one projection's weight, refitted so that its block's output matches a target
stream: ``min_W ‖A W − R‖²`` with ``A`` the projection's inputs (tokens × in) and ``R`` what it
should add to the residual stream (tokens × out). Float64 sums, mergeable across processes, as every
statistic here (``methods/refit.py`` reads them)."""

from __future__ import annotations

import torch

from blockfold.stats.spans import NormalEquations


class ProjectionEquations:
    """``AᵀA``, ``AᵀR``, ``‖R‖²`` and the token count of one projection, over every calibration batch."""

    SUMS = ("tokens", "_xtx", "_xty", "_yty")
    ROWS = ()

    def __init__(self) -> None:
        self.tokens = 0
        self._xtx: torch.Tensor | None = None
        self._xty: torch.Tensor | None = None
        self._yty = 0.0

    def add(self, inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Rows of ``inputs`` (tokens × in) and the contribution ``targets`` (tokens × out) they should
        give; ``weights`` (tokens), each row's weight in the squared error."""
        x, y = inputs.double(), targets.double()
        if weights is not None:
            root = weights.double().sqrt()[:, None]
            x, y = x * root, y * root
        xtx, xty = x.T @ x, x.T @ y
        self._xtx = xtx if self._xtx is None else self._xtx + xtx
        self._xty = xty if self._xty is None else self._xty + xty
        self._yty += float((y * y).sum())
        self.tokens += x.shape[0]

    def merge(self, other: "ProjectionEquations") -> "ProjectionEquations":
        if other._xtx is not None:
            self._xtx = other._xtx.clone() if self._xtx is None else self._xtx + other._xtx
            self._xty = other._xty.clone() if self._xty is None else self._xty + other._xty
        self._yty += other._yty
        self.tokens += other.tokens
        return self

    def finalize(self) -> NormalEquations:
        """The sums as ``NormalEquations`` (``identity_error`` is not meaningful here and is 0)."""
        return NormalEquations(self._xtx, self._xty, self._yty, 0.0, self.tokens)
