"""Selection criteria and strategies."""

from blockfold.select.linearity import (
    LINEARITY_CRITERIA, canonical_correlations, cca_bound, cosine_distance, lowest_scoring, nmse, rank_layers,
    score_layers,
)
from blockfold.select.spans import SpanChoice, best_span

__all__ = [
    "LINEARITY_CRITERIA", "SpanChoice", "best_span", "canonical_correlations", "cca_bound", "cosine_distance",
    "lowest_scoring", "nmse", "rank_layers", "score_layers",
]
