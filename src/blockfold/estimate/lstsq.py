"""Closed-form least squares (optionally ridge) from streamed normal equations."""

from __future__ import annotations

import warnings

import torch

from blockfold.errors import BlockfoldError
from blockfold.stats import NormalEquations

#: ridge added, relative to the mean eigenvalue of XᵀX, when the normal equations are singular
FALLBACK_RELATIVE_RIDGE = 1e-6
#: tenfold raises of that ridge tried where it is not enough (a factor of 1e12 at most)
MAX_RIDGE_STEPS = 12


def solve_normal_equations(
    xtx: torch.Tensor, xty: torch.Tensor, alpha: float = 0.0, warn: bool = True
) -> tuple[torch.Tensor, float]:
    """``argmin_T ‖XT − Y‖² + alpha‖T‖²`` in float64; returns T and the ridge actually used.

    A singular (or numerically indefinite) system gets a small ridge with a warning instead of an
    error, so a rank-deficient calibration set still gives the minimum-norm-like solution.
    """
    xtx, xty = xtx.double(), xty.double()
    eye = torch.eye(xtx.shape[0], dtype=xtx.dtype, device=xtx.device)
    factor, info = torch.linalg.cholesky_ex(xtx + alpha * eye)
    if int(info) == 0 and (alpha > 0 or _well_conditioned(xtx)):  # a ridge needs no eigenvalues
        return torch.cholesky_solve(xty, factor), alpha
    ridge = alpha + FALLBACK_RELATIVE_RIDGE * float(xtx.diagonal().mean().clamp(min=1e-30))
    # raised where still indefinite: sums less the sums of rows recomputed in another batch (a held-out
    # part), whose last bits differ
    for _ in range(1 + MAX_RIDGE_STEPS):
        factor, info = torch.linalg.cholesky_ex(xtx + ridge * eye)
        if int(info) == 0:
            break
        ridge *= 10
    else:
        raise BlockfoldError("the normal equations hold non-finite or wildly scaled values, so no ridge makes them "
                             "solvable: check the model's activations (--dtype float32) and the calibration data")
    if warn:
        warnings.warn(
            f"normal equations are singular (too few or degenerate calibration tokens); "
            f"adding ridge alpha={ridge:.3g}. Give more calibration data or set ridge_alpha",
            stacklevel=3,
        )
    return torch.cholesky_solve(xty, factor), ridge


def _well_conditioned(xtx: torch.Tensor) -> bool:
    """Whether XᵀX's smallest eigenvalue is above 1e-13 of its largest (a solve below that is rounding)."""
    eigen = torch.linalg.eigvalsh(xtx)
    return bool(eigen[0] > eigen[-1] * 1e-13)


def fit_lstsq(equations: NormalEquations, alpha: float = 0.0, warn: bool = True) -> tuple[torch.Tensor, dict]:
    transform, used_alpha = solve_normal_equations(equations.xtx, equations.xty, alpha, warn)
    info = {
        "estimator": "lstsq",
        "ridge_alpha": used_alpha,
        "relative_fit_error": equations.relative_residual(transform),
        "relative_error_plain_removal": equations.relative_error_identity(),
        "tokens": equations.tokens,
    }
    return transform, info
