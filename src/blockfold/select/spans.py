"""Choosing which contiguous span of blocks to remove: the criteria (lower is better) and the
strategies (one span, several non-overlapping spans).

Every criterion is a ``[start, length]`` table, NaN where it is not defined:

* ``angular_last`` / ``angular_all``: angular distance between the residual stream before and after
  the span, at each sequence's last token / over all tokens (ReplaceMe, UIDL);
* ``block_influence``: ``1 − mean cos(h[start], h[start+length])`` over all tokens (ShortGPT's Block
  Influence, for a span);
* ``cka``: ``1 −`` linear CKA between the two streams;
* ``cca``: ``1 −`` the mean squared canonical correlation between them;
* ``fit_error``: the relative residual ``‖XT − Y‖² / ‖Y‖²`` of the map the estimator fits for this
  span: how well a linear map can replace the span, not how little the span changes the stream;
* ``fit_error_stream``: the same map's error per token relative to the residual stream after the
  span, ``mean_t ‖x_t T − y_t‖² / ‖h_t‖²``: what the downstream blocks see of the map's mistakes.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from blockfold.errors import BlockfoldError
from blockfold.select.linearity import canonical_correlations
from blockfold.stats import LinearStatistics, NormalEquations, SpanTable
from blockfold.stats.similarity import StreamMoments

SPAN_CRITERIA = ("angular_last", "angular_all", "block_influence", "cka", "cca", "fit_error", "fit_error_stream")


def linear_cka(stats: LinearStatistics) -> float:
    """Linear CKA of centred ``x`` and ``y``: ``‖C_yx‖²_F / (‖C_xx‖_F ‖C_yy‖_F)``, in [0, 1]."""
    cross = float((stats.cov_yx**2).sum())
    return cross / max(float(stats.cov_xx.norm() * stats.cov_yy.norm()), 1e-300)


def mean_squared_canonical_correlation(stats: LinearStatistics) -> float:
    return float((canonical_correlations(stats) ** 2).mean())


def span_criteria(
    distances: SpanTable,
    fit_tables: list[SpanTable],
    moments: StreamMoments | None,
    fit: Callable[[NormalEquations], torch.Tensor] | None,
) -> dict[str, np.ndarray]:
    """Every criterion's ``[start, length]`` table (NaN where it was not measured). ``distances`` gives
    the angular and cosine ones, each of ``fit_tables`` the fit errors at its ``fit_length``, ``moments``
    CKA and CCA; ``fit`` maps a span's normal equations to the transform the estimator would fold
    (None: plain removal, scored from the scalar sums alone). Candidates whose full sums were not
    accumulated (screened out) have no fit error."""
    shape = distances.angular_all.shape
    scores = {
        "angular_last": distances.angular_last,
        "angular_all": distances.angular_all,
        "block_influence": 1.0 - distances.cosine_all,
        **{name: np.full(shape, np.nan) for name in ("cka", "cca", "fit_error", "fit_error_stream")},
    }
    if moments is not None:
        for start, length in moments.cross:
            pair = moments.pair(start, length)
            scores["cka"][start, length] = 1.0 - linear_cka(pair)
            scores["cca"][start, length] = 1.0 - mean_squared_canonical_correlation(pair)
    for table in fit_tables:
        for start, equations in table.normal_equations.items():
            weighted = table.stream_weighted_equations.get(start)
            if fit is None:  # plain removal: the identity's errors are scalar sums
                scores["fit_error"][start, table.fit_length] = equations.relative_error_identity()
                if weighted is not None:
                    scores["fit_error_stream"][start, table.fit_length] = weighted.identity_error / max(weighted.tokens, 1)
                continue
            if equations.xtx is None:
                continue
            transform = fit(equations)
            scores["fit_error"][start, table.fit_length] = equations.relative_residual(transform)
            if weighted is not None and weighted.xtx is not None:
                scores["fit_error_stream"][start, table.fit_length] = weighted.residual(transform) / max(weighted.tokens, 1)
    return scores


def by_start(scores: np.ndarray, length: int, min_start: int = 1) -> dict[int, float]:
    """``{start: score}`` of the admissible spans of ``length`` where the criterion is defined."""
    return {int(s): float(scores[s, length]) for s in range(min_start, scores.shape[0]) if np.isfinite(scores[s, length])}


def span_label(blocks: list[int]) -> str:
    """``"12-19"`` for a contiguous run of blocks, ``"12"`` for one, else the blocks comma-separated."""
    if len(blocks) > 1 and blocks == list(range(blocks[0], blocks[-1] + 1)):
        return f"{blocks[0]}-{blocks[-1]}"
    return ",".join(map(str, blocks))


@dataclass
class SpanChoice:
    start: int
    length: int
    score: float
    criterion: str
    candidates: dict[int, float]  # every admissible start → its score (lower is better)

    @property
    def blocks(self) -> list[int]:
        return list(range(self.start, self.start + self.length))


def best_span(
    scores: np.ndarray, length: int, criterion: str, min_start: int = 1, fixed_start: int | None = None
) -> SpanChoice:
    """The admissible span of ``length`` blocks with the lowest score (or the one at ``fixed_start``);
    never the first block."""
    candidates = by_start(scores, length, min_start)
    if not candidates:
        raise BlockfoldError(f"no span of {length} blocks fits this model: remove fewer blocks")
    if fixed_start is not None and fixed_start not in candidates:
        raise BlockfoldError(
            f"span start {fixed_start} is not admissible for {length} blocks: use a start in "
            f"{min(candidates)}..{max(candidates)}"
        )
    start = fixed_start if fixed_start is not None else min(candidates, key=candidates.__getitem__)
    return SpanChoice(start, length, candidates[start], criterion, candidates)


def spans_apart(scores: np.ndarray, length: int, criterion: str, count: int, min_start: int = 1) -> list[SpanChoice]:
    """Up to ``count`` spans of ``length`` blocks, best score first, none overlapping a better one: the
    criterion's best at different depths, for a measure the scores stand in for to decide between."""
    candidates = by_start(scores, length, min_start)
    if not candidates:
        raise BlockfoldError(f"no span of {length} blocks fits this model: remove fewer blocks")
    kept: list[SpanChoice] = []
    for start in sorted(candidates, key=candidates.__getitem__):
        if len(kept) == count:
            break
        if all(abs(start - other.start) >= length for other in kept):
            kept.append(SpanChoice(start, length, candidates[start], criterion, candidates))
    return kept


def split_budget(blocks: int, spans: int) -> list[int]:
    """``blocks`` shared as evenly as possible by ``spans`` spans, longest first."""
    base, extra = divmod(blocks, spans)
    return [base + 1] * extra + [base] * (spans - extra)


def best_spans(scores: np.ndarray, lengths: list[int], criterion: str, min_start: int = 1) -> list[SpanChoice]:
    """Non-overlapping spans, one of each length in ``lengths`` in whatever order along the depth
    minimises the summed score; spans that touch are merged into one (one transform).

    Exhaustive over orders, dynamic programming over positions: O(k!·k·L²) for k spans, L blocks.
    """
    def valid(start: int, length: int) -> bool:
        return start < scores.shape[0] and length < scores.shape[1] and bool(np.isfinite(scores[start, length]))

    @functools.cache
    def place(order: tuple[int, ...], earliest: int) -> tuple[float, tuple[int, ...]]:
        if not order:
            return 0.0, ()
        best: tuple[float, tuple[int, ...]] = (math.inf, ())
        for start in range(earliest, scores.shape[0]):
            if valid(start, order[0]):
                rest, starts = place(order[1:], start + order[0])
                total = float(scores[start, order[0]]) + rest
                if total < best[0]:
                    best = (total, (start, *starts))
        return best

    total, starts, order = min((*place(order, min_start), order) for order in set(itertools.permutations(lengths)))
    if not math.isfinite(total):
        raise BlockfoldError(f"{len(lengths)} spans of {', '.join(map(str, lengths))} blocks do not fit this model: "
                             "remove fewer blocks or use fewer spans")
    merged: list[list[int]] = []  # [start, length]
    for start, length in zip(starts, order):
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1][1] += length
        else:
            merged.append([start, length])
    return [SpanChoice(start, length, float(scores[start, length]) if valid(start, length) else math.nan, criterion,
                       by_start(scores, length)) for start, length in merged]
