"""Streaming statistics: observers that fold each layer's activations into float64 sums, with
bounded windows, whichever pipeline feeds them."""

from blockfold.stats.activations import LayerActivations, Observer
from blockfold.stats.linearity import LinearStatistics, SublayerLinearity
from blockfold.stats.sample import SpanRows, SpanSample
from blockfold.stats.spans import NormalEquations, SpanStatistics, SpanTable

__all__ = [
    "LayerActivations", "LinearStatistics", "NormalEquations", "Observer", "SpanRows", "SpanSample",
    "SpanStatistics", "SpanTable", "SublayerLinearity",
]
