"""Constrained span-replacing maps, each in closed form from the same streamed normal equations.

With ``X`` the MLP contribution of the block before the span and ``Y`` what the map must produce
(``XᵀX``, ``XᵀY`` and ``ΣyᵀY`` are all that is kept), each estimator solves ``min ‖XT − Y‖²`` over
its family of ``T``:

* ``diagonal``: one scale per hidden dimension, ``t_j = (XᵀY)_jj / ((XᵀX)_jj + α)``;
* ``orthogonal``: a rotation (orthogonal Procrustes), ``T = U Vᵀ`` from ``XᵀY = U S Vᵀ``;
* ``lowrank``: the identity plus a rank-``r`` correction, ``T = I + M``. With ``Z = Y − X`` this is
  reduced-rank regression: ``M = M_ls P_r`` where ``M_ls`` is the least-squares ``M`` and ``P_r``
  projects onto the ``r`` leading right singular directions of the fitted values ``X M_ls``; the
  ridge shrinks ``M`` towards 0, i.e. ``T`` towards plain removal.
"""

from __future__ import annotations

import torch

from blockfold.estimate.lstsq import solve_normal_equations
from blockfold.stats import NormalEquations


def _info(equations: NormalEquations, estimator: str, transform: torch.Tensor, **extra) -> dict:
    return {
        "estimator": estimator,
        "relative_fit_error": equations.relative_residual(transform),
        "relative_error_plain_removal": equations.relative_error_identity(),
        "tokens": equations.tokens,
        "parameters_fitted": extra.pop("parameters_fitted"),
        **extra,
    }


def fit_diagonal(equations: NormalEquations, alpha: float = 0.0) -> tuple[torch.Tensor, dict]:
    xtx, xty = equations.xtx.double(), equations.xty.double()
    scale = xty.diagonal() / (xtx.diagonal() + alpha).clamp(min=1e-300)
    transform = torch.diag(scale)
    return transform, _info(equations, "diagonal", transform, ridge_alpha=alpha, parameters_fitted=scale.numel())


def fit_orthogonal(equations: NormalEquations) -> tuple[torch.Tensor, dict]:
    left, _, right_t = torch.linalg.svd(equations.xty.double())
    transform = left @ right_t
    d = transform.shape[0]
    return transform, _info(equations, "orthogonal", transform, parameters_fitted=d * (d - 1) // 2)


def fit_lowrank(equations: NormalEquations, rank: int, alpha: float = 0.0) -> tuple[torch.Tensor, dict]:
    xtx = equations.xtx.double()
    d = xtx.shape[0]
    rank = min(rank, d)
    xtz = equations.xty.double() - xtx  # Xᵀ(Y − X)
    correction, used_alpha = solve_normal_equations(xtx, xtz, alpha)
    fitted_gram = correction.T @ xtx @ correction  # (X M_ls)ᵀ (X M_ls)
    _, vectors = torch.linalg.eigh((fitted_gram + fitted_gram.T) / 2)
    leading = vectors[:, -rank:]
    transform = torch.eye(d, dtype=torch.float64, device=xtx.device) + correction @ leading @ leading.T
    return transform, _info(equations, "lowrank", transform, rank=rank, ridge_alpha=used_alpha,
                            parameters_fitted=2 * d * rank)
