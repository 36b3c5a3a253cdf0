"""How replaceable a sublayer is by a linear map, from its ``LinearStatistics``; lower is more linear.

* ``cca``: NBL's bound ``Σᵢ (1 − ρᵢ²)`` over the canonical correlations ρ of input and contribution.
  It is the LMMSE error of predicting the *whitened* contribution, so every output direction counts
  equally, however little variance it carries; it lies in ``[0, rank C_yy]``. Directions in which the
  contribution does not vary at all (a rank-deficient output) are predicted exactly by the bias and
  add nothing. The registry uses the sum
  (the paper's form); ``per_dimension=True`` divides by ``d_out`` to compare models of other widths.
  Ranking the layers of one model is the same either way.
* ``nmse``: the relative error of the LMMSE map itself, ``Tr(C_yy − C_yx C_xx⁻¹ C_xy) / Tr C_yy``,
  which weights directions by their variance.
* ``cosine``: DROP's ``1 − mean cos(residual before, residual after)``: how little the sublayer turns
  the residual stream, i.e. how well plain removal would do.
* ``stream``: the LMMSE map's squared error relative to the residual stream it is added to, per
  token, ``mean_t ‖y_t − ŷ_t‖² / ‖h_t + y_t‖²``: what replacing the sublayer perturbs, on the scale
  DROP's cosine judges plain removal on. ``cca`` and ``nmse`` are scale-free: a sublayer that adds
  little to the stream, nonlinearly, looks bad to them although replacing it costs little. (A
  ratio of totals, ``E‖y − ŷ‖² / E‖h + y‖²``, was tried first: the few tokens with massive
  activations dominate its denominator and it picked the worst layers; see BENCHMARKS.md.)
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from blockfold.errors import BlockfoldError
from blockfold.estimate.lmmse import fit_lmmse
from blockfold.stats.linearity import LinearStatistics

#: covariance eigen-directions with less than this fraction of the largest variance are treated as
#: constant and left out before whitening. float32 rounding alone puts ~1e-15 of the largest variance
#: into every direction; whitening such noise would turn it into spurious correlations.
SUPPORT_FLOOR = 1e-10


def _whitener(cov: torch.Tensor) -> torch.Tensor:
    """``Λ^-½ Vᵀ`` on the directions where ``cov`` has variance: (rank, d), so ``W C Wᵀ = I``."""
    eigenvalues, vectors = torch.linalg.eigh(cov)
    support = eigenvalues > SUPPORT_FLOOR * float(eigenvalues[-1])
    return (vectors[:, support] * eigenvalues[support].rsqrt()).T


def canonical_correlations(stats: LinearStatistics) -> torch.Tensor:
    """ρ: the singular values of ``C_yy^-½ C_yx C_xx^-½`` on the supports of ``C_yy`` and ``C_xx``,
    descending, in [0, 1]."""
    whitened = _whitener(stats.cov_yy) @ stats.cov_yx @ _whitener(stats.cov_xx).T
    return torch.linalg.svdvals(whitened).clamp(max=1.0)  # rounding can put ρ a hair above 1


def cca_bound(stats: LinearStatistics, per_dimension: bool = False) -> float:
    """``Σᵢ (1 − ρᵢ²)`` over the directions in which the output varies (ρᵢ = 0 beyond the number of
    correlations); ``per_dimension`` divides by ``d_out``."""
    rank = _whitener(stats.cov_yy).shape[0]
    bound = rank - float((canonical_correlations(stats) ** 2).sum())
    return bound / stats.cov_yy.shape[0] if per_dimension else bound


def nmse(stats: LinearStatistics) -> float:
    return fit_lmmse(stats)[2]["nmse"]


def cosine_distance(stats: LinearStatistics) -> float:
    return 1.0 - stats.mean_cosine


def stream_error(stats: LinearStatistics) -> float:
    weight, bias, _ = fit_lmmse(stats)
    return stats.relative_stream_error(weight, bias)


LINEARITY_CRITERIA: dict[str, Callable[[LinearStatistics], float]] = {
    "cca": cca_bound,
    "nmse": nmse,
    "cosine": cosine_distance,
    "stream": stream_error,
}


def score_layers(statistics: list[LinearStatistics], criterion: str) -> list[float]:
    """Every layer's score under ``criterion`` (lower is more linear)."""
    if criterion not in LINEARITY_CRITERIA:
        raise BlockfoldError(
            f"unknown linearity criterion {criterion!r}: use one of {', '.join(LINEARITY_CRITERIA)}"
        )
    return [LINEARITY_CRITERIA[criterion](stats) for stats in statistics]


def rank_layers(
    statistics: list[LinearStatistics], criterion: str, k: int, exclude: Collection[int] = frozenset()
) -> list[int]:
    """The ``k`` layers outside ``exclude`` with the lowest score, most linear first."""
    return lowest_scoring(dict(enumerate(score_layers(statistics, criterion))), k, exclude)


def lowest_scoring(scores: dict[int, float], k: int, exclude: Collection[int] = frozenset()) -> list[int]:
    """The ``k`` keys outside ``exclude`` with the lowest score, lowest first."""
    candidates = [index for index in scores if index not in exclude]
    if not 1 <= k <= len(candidates):
        raise BlockfoldError(
            f"cannot pick {k} layers from {len(candidates)} candidates: use k in 1..{len(candidates)}"
        )
    return sorted(candidates, key=scores.__getitem__)[:k]
