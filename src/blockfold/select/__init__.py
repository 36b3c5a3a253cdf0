"""Selection criteria and strategies."""

from blockfold.select.linearity import (
    LINEARITY_CRITERIA, canonical_correlations, cca_bound, cosine_distance, lowest_scoring, nmse, rank_layers,
    score_layers,
)
from blockfold.select.spans import (
    SPAN_CRITERIA, SpanChoice, best_span, best_spans, by_start, linear_cka, span_criteria, span_label,
    spans_apart, split_budget,
)

__all__ = [
    "LINEARITY_CRITERIA", "SPAN_CRITERIA", "SpanChoice", "best_span", "best_spans", "by_start", "canonical_correlations",
    "cca_bound", "cosine_distance", "linear_cka", "lowest_scoring", "nmse", "rank_layers", "score_layers",
    "span_criteria", "span_label", "spans_apart", "split_budget",
]
