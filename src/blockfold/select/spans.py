"""Choosing which contiguous span of blocks to remove."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from blockfold.errors import BlockfoldError


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
    column = scores[:, length]
    candidates = {int(s): float(column[s]) for s in range(min_start, len(column)) if np.isfinite(column[s])}
    if not candidates:
        raise BlockfoldError(f"no span of {length} blocks fits this model: remove fewer blocks")
    if fixed_start is not None and fixed_start not in candidates:
        raise BlockfoldError(
            f"span start {fixed_start} is not admissible for {length} blocks: use a start in "
            f"{min(candidates)}..{max(candidates)}"
        )
    start = fixed_start if fixed_start is not None else min(candidates, key=candidates.__getitem__)
    return SpanChoice(start, length, candidates[start], criterion, candidates)
