"""Estimators of the linear maps that replace a span of blocks or a sublayer."""

from blockfold.estimate.lmmse import fit_lmmse
from blockfold.estimate.lstsq import fit_lstsq, solve_normal_equations
from blockfold.estimate.numeric import fit_numerically, linear_contribution, span_loss

__all__ = [
    "fit_lmmse", "fit_lstsq", "fit_numerically", "linear_contribution", "solve_normal_equations", "span_loss",
]
