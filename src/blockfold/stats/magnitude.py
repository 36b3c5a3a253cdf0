"""The residual stream at block boundaries, per channel and between two boundaries: the magnitude a
removed block leaves missing (Prune&Comp, ``methods/prune_comp.py``), the rotated magnitudes and the
normal equations a patch across a removed span is fitted from (LinearPatch, ``methods/linear_patch.py``)."""

from __future__ import annotations

import torch

from blockfold.errors import BlockfoldError
from blockfold.estimate.hadamard import hadamard
from blockfold.stats.activations import LayerActivations
from blockfold.stats.spans import NormalEquations
from blockfold.stats.sums import add_sum


def _boundaries(acts: LayerActivations):
    """(boundary index, hidden state) pairs this layer's activations give: 0 = the first block's input."""
    if acts.index == 0:
        yield 0, acts.block_in
    yield acts.index + 1, acts.block_out


class StreamMagnitude:
    """Observer: ``Σ_t |h_k[t, c]|`` for every boundary ``k`` (or those listed) and channel ``c``;
    ``rotated``: of ``h_k H``, ``H`` the orthonormal Hadamard matrix of the hidden size."""

    SUMS = ("tokens", "_abs_sum")
    ROWS = ()

    def __init__(self, num_layers: int, boundaries: list[int] | None = None, rotated: bool = False):
        self.num_layers = num_layers
        self.boundaries = sorted(boundaries) if boundaries is not None else list(range(num_layers + 1))
        self.rotated = rotated
        self.last_layer = max(self.boundaries[-1] - 1, 0)
        self.tokens = 0
        self._abs_sum: dict[int, torch.Tensor] = {}
        self._rotation: torch.Tensor | None = None  # H on the activations' device, built once

    def sums_bytes(self, hidden_size: int) -> int:
        return len(self.boundaries) * hidden_size * 8 + (hidden_size * hidden_size * 8 if self.rotated else 0)

    def window_bytes_per_token(self, hidden_size: int, element: int = 4) -> int:
        return 2 * hidden_size * 8  # the float64 |h| (and its rotation) of one boundary, summed at once

    def on_layer(self, acts: LayerActivations) -> None:
        if acts.index == 0:
            self.tokens += acts.block_in.shape[0]
        for boundary, hidden in _boundaries(acts):
            if boundary in self.boundaries:
                h = hidden.double()
                if self.rotated:
                    if self._rotation is None or self._rotation.device != h.device:
                        self._rotation = hadamard(h.shape[-1]).to(h.device)
                    h = h @ self._rotation
                add_sum(self._abs_sum, boundary, h.abs().sum(0))

    def end_batch(self) -> None:
        pass

    def merge(self, other: "StreamMagnitude") -> "StreamMagnitude":
        if (other.num_layers, other.boundaries, other.rotated) != (self.num_layers, self.boundaries, self.rotated):
            raise BlockfoldError("cannot merge stream magnitudes of different models or boundaries: merge shards of one pass")
        self.tokens += other.tokens
        for key, value in other._abs_sum.items():
            add_sum(self._abs_sum, key, value)
        return self

    def finalize(self) -> dict[int, torch.Tensor]:
        """Boundary → the mean absolute value of each (rotated) channel there, float64."""
        if self.tokens == 0:
            raise BlockfoldError("no calibration tokens were streamed: stream some batches before finalize")
        return {boundary: self._abs_sum[boundary] / self.tokens for boundary in self.boundaries}


class BoundaryEquations:
    """Observer: the normal equations of ``h[end] ≈ h[start] T``, one map on the whole residual stream
    across the blocks ``start..end-1`` (float64 sums)."""

    SUMS = ("tokens", "_xtx", "_xty", "_yty", "_identity")
    ROWS = ()

    def __init__(self, start: int, end: int):
        if not 0 <= start < end:
            raise BlockfoldError(f"no span between boundaries {start} and {end}")
        self.start, self.end = start, end
        self.last_layer = end - 1
        self.tokens = 0
        self._xtx = self._xty = None
        self._yty = self._identity = 0.0
        self._x: torch.Tensor | None = None

    def sums_bytes(self, hidden_size: int) -> int:
        return 2 * hidden_size * hidden_size * 8

    def window_bytes_per_token(self, hidden_size: int, element: int = 4) -> int:
        return hidden_size * element

    def on_layer(self, acts: LayerActivations) -> None:
        for boundary, hidden in _boundaries(acts):
            if boundary == self.start:
                self._x = hidden
            elif boundary == self.end:
                x, y = self._x.double(), hidden.double()
                self.tokens += x.shape[0]
                self._xtx = x.T @ x if self._xtx is None else self._xtx + x.T @ x
                self._xty = x.T @ y if self._xty is None else self._xty + x.T @ y
                self._yty += float((y * y).sum())
                self._identity += float(((y - x) ** 2).sum())

    def end_batch(self) -> None:
        self._x = None

    def merge(self, other: "BoundaryEquations") -> "BoundaryEquations":
        if (other.start, other.end) != (self.start, self.end):
            raise BlockfoldError("cannot merge the equations of different spans: merge shards of one pass")
        if other._xtx is not None:
            self._xtx = other._xtx.clone() if self._xtx is None else self._xtx + other._xtx
            self._xty = other._xty.clone() if self._xty is None else self._xty + other._xty
        self.tokens += other.tokens
        self._yty += other._yty
        self._identity += other._identity
        return self

    def finalize(self) -> NormalEquations:
        if self.tokens == 0:
            raise BlockfoldError("no calibration tokens were streamed: stream some batches before finalize")
        return NormalEquations(self._xtx, self._xty, self._yty, self._identity, self.tokens)
