"""Estimators of the linear maps that replace a span of blocks or a sublayer."""

from blockfold.estimate.constrained import fit_diagonal, fit_lowrank, fit_orthogonal
from blockfold.estimate.lmmse import fit_lmmse
from blockfold.estimate.lstsq import fit_lstsq, solve_normal_equations
from blockfold.estimate.numeric import fit_numerically, linear_contribution, span_loss
from blockfold.estimate.spanmap import CLOSED_FORM_ESTIMATORS, fit_span_map

__all__ = [
    "CLOSED_FORM_ESTIMATORS", "fit_diagonal", "fit_lmmse", "fit_lowrank", "fit_lstsq", "fit_numerically",
    "fit_orthogonal", "fit_span_map", "linear_contribution", "solve_normal_equations", "span_loss",
]
