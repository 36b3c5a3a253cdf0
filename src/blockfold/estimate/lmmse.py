"""The linear minimum-mean-square-error map of a sublayer (NBL's replacement), from its moments."""

from __future__ import annotations

import torch

from blockfold.estimate.lstsq import solve_normal_equations
from blockfold.stats.linearity import LinearStatistics


def fit_lmmse(stats: LinearStatistics, ridge_alpha: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``W = C_yx C_xx⁻¹`` and ``b = E[y] − W E[x]``, so that ``y ≈ x Wᵀ + b`` (``W`` is an
    ``nn.Linear`` weight, d_out × d_in).

    ``ridge_alpha`` is added to the covariance ``C_xx``, i.e. per token, so it does not grow with the
    calibration set; an ill-conditioned ``C_xx`` gets a small ridge with a warning.
    """
    transposed, used_alpha = solve_normal_equations(stats.cov_xx, stats.cov_yx.T, ridge_alpha)
    weight = transposed.T
    bias = stats.mean_y - weight @ stats.mean_x
    info = {
        "estimator": "lmmse",
        "ridge_alpha": used_alpha,
        "nmse": stats.relative_residual(weight),
        "tokens": stats.tokens,
    }
    return weight, bias, info
