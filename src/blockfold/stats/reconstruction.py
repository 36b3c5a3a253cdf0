"""Normal equations of one projection's weight, refitted so that its block's output matches a target
stream: ``min_W ‖A W − R‖²`` with ``A`` the projection's inputs (tokens × in) and ``R`` what it
should add to the residual stream (tokens × out). Float64 sums, mergeable across processes, as every
statistic here (``methods/refit.py`` reads them).

With ``kept`` rows (``H``, the rest of the block's output, which the refit leaves as it is) the sums
also serve ``min_{W,β} ‖A W + β H − R‖²``: a scalar on the whole stream fitted with the weight.
"""

from __future__ import annotations

import logging

import torch

from blockfold.estimate.lstsq import solve_normal_equations
from blockfold.stats.spans import NormalEquations

logger = logging.getLogger(__name__)


class ProjectionEquations:
    """``AᵀA``, ``AᵀR``, ``‖R‖²`` and the token count of one projection, over every calibration batch;
    with ``kept`` rows also ``AᵀH``, ``‖H‖²`` and ``⟨H, R⟩``."""

    SUMS = ("tokens", "_xtx", "_xty", "_yty", "_xth", "_hth", "_htr")
    ROWS = ()

    def __init__(self) -> None:
        self.tokens = 0
        self._xtx: torch.Tensor | None = None
        self._xty: torch.Tensor | None = None
        self._yty = 0.0
        self._xth: torch.Tensor | None = None
        self._hth = 0.0
        self._htr = 0.0

    def add(self, inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None,
            kept: torch.Tensor | None = None) -> None:
        """Rows of ``inputs`` (tokens × in) and the contribution ``targets`` (tokens × out) they should
        give; ``weights`` (tokens), each row's weight in the squared error; ``kept`` (tokens × out), the
        rest of the block's output, for the stream scale."""
        x, y = inputs.double(), targets.double()
        h = kept.double() if kept is not None else None
        if weights is not None:
            root = weights.double().sqrt()[:, None]
            x, y = x * root, y * root
            h = h * root if h is not None else None
        xtx, xty = x.T @ x, x.T @ y
        self._xtx = xtx if self._xtx is None else self._xtx + xtx
        self._xty = xty if self._xty is None else self._xty + xty
        self._yty += float((y * y).sum())
        if h is not None:
            xth = x.T @ h
            self._xth = xth if self._xth is None else self._xth + xth
            self._hth += float((h * h).sum())
            self._htr += float((h * y).sum())
        self.tokens += x.shape[0]

    def merge(self, other: "ProjectionEquations") -> "ProjectionEquations":
        if other._xtx is not None:
            self._xtx = other._xtx.clone() if self._xtx is None else self._xtx + other._xtx
            self._xty = other._xty.clone() if self._xty is None else self._xty + other._xty
        if other._xth is not None:
            self._xth = other._xth.clone() if self._xth is None else self._xth + other._xth
        self._yty += other._yty
        self._hth += other._hth
        self._htr += other._htr
        self.tokens += other.tokens
        return self

    def stream_scale(self, ridge: float, current: torch.Tensor) -> tuple[torch.Tensor, float, float]:
        """``argmin_{W,s} ‖A W + (s − 1) H − R‖² + ridge ‖W − current‖²``: the weight, the scale ``s`` of
        the kept part, and the relative residual ``‖A W + (s − 1) H − R‖² / ‖R‖²``. For each ``s`` the
        weight is the ridge solve for the target ``R − (s − 1) H``, linear in ``s``; the optimal ``s``
        makes the residual orthogonal to ``H`` (closed form). ``s = 1`` (the plain refit) where ``H``
        lies in the span of ``A``, and where the optimum is ``s <= 0``: a flipped or vanished stream
        cannot be folded through the later blocks' norms. Both solves share one factorization."""
        if self._xth is None:
            raise ValueError("stream_scale needs the kept rows: pass kept= to add()")
        outputs = self._xty.shape[1]
        both, _ = solve_normal_equations(self._xtx, torch.cat([self._xty + ridge * current, self._xth], dim=1), ridge)
        fitted, through_kept = both[:, :outputs], both[:, outputs:]
        unexplained = self._hth - float((self._xth * through_kept).sum())
        shift = 0.0
        if unexplained > 1e-12 * max(self._hth, 1e-300):
            shift = (self._htr - float((self._xth * fitted).sum())) / unexplained
        if not shift > -1.0:
            logger.warning("the refit asked for a stream scale of %.4g; keeping the plain refit", 1.0 + shift)
            shift = 0.0
        weight = fitted - shift * through_kept
        residual = (self.finalize().residual(weight)
                    - 2 * shift * (self._htr - float((self._xth * weight).sum())) + shift ** 2 * self._hth)
        return weight, 1.0 + shift, residual / max(self._yty, 1e-300)

    def finalize(self) -> NormalEquations:
        """The sums as ``NormalEquations`` (``identity_error`` is not meaningful here and is 0)."""
        return NormalEquations(self._xtx, self._xty, self._yty, 0.0, self.tokens)
