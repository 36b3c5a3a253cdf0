"""Streaming statistics: hooks at adapter-named points, float64 accumulators, bounded memory."""

from blockfold.stats.engine import LayerActivations, Observer, stream_activations
from blockfold.stats.linearity import LinearStatistics, SublayerLinearity
from blockfold.stats.sample import SpanRows, SpanSample
from blockfold.stats.spans import NormalEquations, SpanStatistics, SpanTable

__all__ = [
    "LayerActivations", "LinearStatistics", "NormalEquations", "Observer", "SpanRows", "SpanSample",
    "SpanStatistics", "SpanTable", "SublayerLinearity", "stream_activations",
]
