"""Selection criteria and strategies."""

from blockfold.select.spans import SpanChoice, best_span

__all__ = ["SpanChoice", "best_span"]
