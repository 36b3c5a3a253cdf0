"""One entry point for the closed-form span-replacing maps, so selection can score every candidate
span with the map that would actually be folded."""

from __future__ import annotations

import torch

from blockfold.errors import BlockfoldError
from blockfold.estimate.constrained import fit_diagonal, fit_lowrank, fit_orthogonal
from blockfold.estimate.lstsq import fit_lstsq
from blockfold.stats import NormalEquations

CLOSED_FORM_ESTIMATORS = ("lstsq", "diagonal", "orthogonal", "lowrank", "identity")


def fit_span_map(
    equations: NormalEquations, estimator: str, ridge_alpha: float = 0.0, rank: int | None = None, warn: bool = True
) -> tuple[torch.Tensor | None, dict]:
    """The ``estimator``'s map from the normal equations (``cosine`` starts from, and here means, lstsq);
    ``identity`` (plain removal) has no map to fold and returns None.

    ``ridge_alpha`` is per token, as NBL's (added to ``XᵀX / tokens``), so a value means the same
    whatever the size of the calibration set; the info reports it per token too.
    """
    alpha = ridge_alpha * max(equations.tokens, 1)
    if estimator in ("lstsq", "cosine"):
        transform, info = fit_lstsq(equations, alpha, warn)
    elif estimator == "diagonal":
        transform, info = fit_diagonal(equations, alpha)
    elif estimator == "orthogonal":
        transform, info = fit_orthogonal(equations)
    elif estimator == "lowrank":
        if rank is None:
            raise BlockfoldError("the lowrank estimator needs a rank: pass --rank R")
        transform, info = fit_lowrank(equations, rank, alpha)
    elif estimator == "identity":  # plain removal of the span, for comparison: nothing is folded
        error = equations.relative_error_identity()
        return None, {"estimator": "identity", "relative_fit_error": error, "relative_error_plain_removal": error,
                      "tokens": equations.tokens}
    else:
        raise BlockfoldError(f"unknown estimator {estimator!r}: use one of {', '.join(CLOSED_FORM_ESTIMATORS)} or cosine")
    if "ridge_alpha" in info:
        info["ridge_alpha"] = info["ridge_alpha"] / max(equations.tokens, 1)
    return transform, info
