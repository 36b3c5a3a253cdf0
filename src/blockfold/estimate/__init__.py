"""Estimators of the linear map that replaces a span."""

from blockfold.estimate.lstsq import fit_lstsq, solve_normal_equations
from blockfold.estimate.numeric import fit_numerically, linear_contribution, span_loss

__all__ = ["fit_lstsq", "fit_numerically", "linear_contribution", "solve_normal_equations", "span_loss"]
