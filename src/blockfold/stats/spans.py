"""Statistics of spans of consecutive blocks, accumulated in one streaming pass.

Notation (0-based): ``h[k]`` is the residual stream entering block ``k`` (``h[L]`` leaves the last
block, before the final norm). A span ``(start, length)`` removes blocks ``start .. start+length-1``
and is judged by how far ``h[start+length]`` is from ``h[start]``.

For ReplaceMe, the span starting at ``i`` is replaced by a linear map ``T`` on the MLP contribution
``x`` of block ``i-1``: ``a + x T ≈ h[i+n]`` where ``a`` is block ``i-1``'s residual after attention.
With ``y = h[i+n] - a`` the least-squares problem needs only the sums ``XᵀX``, ``XᵀY`` and ``ΣyᵀY``,
which are accumulated here in float64 for every candidate start, so selection may use the fit
error itself and no second pass is needed for the closed-form estimator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from blockfold.stats.activations import LayerActivations
from blockfold.stats.sums import add_sum, add_sums


@dataclass
class NormalEquations:
    """Sums for ``min_T ‖X T − Y‖²``; ``tokens`` rows went into them."""

    xtx: torch.Tensor | None  # (d, d) float64; None where only the scalars were accumulated
    xty: torch.Tensor | None  # (d, d) float64
    yty_trace: float
    identity_error: float  # ‖X − Y‖²: the error of T = I, i.e. plain removal of the span
    tokens: int

    def residual(self, transform: torch.Tensor) -> float:
        """‖X T − Y‖² from the sums alone."""
        t = transform.double()
        return float(self.yty_trace - 2 * (t * self.xty).sum() + (t * (self.xtx @ t)).sum())

    def relative_residual(self, transform: torch.Tensor) -> float:
        return self.residual(transform) / max(self.yty_trace, 1e-300)

    def relative_error_identity(self) -> float:
        """Relative error of keeping the block before the span as it is (plain removal)."""
        return self.identity_error / max(self.yty_trace, 1e-300)

    def less(self, part: "NormalEquations") -> "NormalEquations":
        """The sums without ``part``'s, rows that went into both: the fit on the other rows alone."""
        return NormalEquations(None if self.xtx is None else self.xtx - part.xtx,
                               None if self.xty is None else self.xty - part.xty, self.yty_trace - part.yty_trace,
                               self.identity_error - part.identity_error, self.tokens - part.tokens)


@dataclass
class SpanTable:
    """Mean distances per ``[start, length]`` (NaN where a span does not fit)."""

    angular_all: np.ndarray
    angular_last: np.ndarray
    cosine_all: np.ndarray
    normal_equations: dict[int, NormalEquations]
    # the same sums with each token weighted by 1/‖h[start+length]‖² (the residual stream after the
    # span): their residual divided by ``tokens`` is the map's mean per-token error relative to the
    # stream it is added to, which massive-activation tokens cannot dominate
    stream_weighted_equations: dict[int, NormalEquations]
    fit_length: int
    tokens: int
    # start → the diagonal map's fit_error and fit_error_stream (screening passes only): each fit
    # criterion screens candidates by its own cheap stand-in
    diagonal_fit_error: dict[int, float] = field(default_factory=dict)
    diagonal_fit_error_stream: dict[int, float] = field(default_factory=dict)

    def criterion(self, name: str) -> np.ndarray:
        return {"angular_all": self.angular_all, "angular_last": self.angular_last}[name]


def _unit_rows(hidden: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit length in float64, so each span's cosine is one row-wise dot product."""
    hidden = hidden.double()
    return hidden / hidden.norm(dim=-1, keepdim=True).clamp(min=1e-30)


#: what is accumulated for each candidate start: ``full`` normal equations (d×d), their ``diagonal``
#: only (d numbers: enough to score a per-channel map, for screening), or ``none`` (the scalars
#: ‖Y‖² and the plain-removal error only)
EQUATIONS = ("full", "diagonal", "none")


class SpanStatistics:
    """Observer: distances of all spans up to ``max_length`` and sums per candidate start at ``fit_length``.

    Within a group of sequences it keeps a window of recent layers (float32: the residual stream at
    the last ``max(max_length, fit_length) + 1`` boundaries, the map's input for open candidates), so
    its memory is ``window_bytes_per_token`` times the group's tokens plus ``sums_bytes``.
    """

    SUMS = ("angular_all", "angular_last", "cosine_all", "tokens", "sequences", "_xtx", "_xty", "_yty",
            "_identity_error", "_weighted")
    ROWS = ()

    def __init__(
        self,
        num_layers: int,
        max_length: int,
        fit_length: int | None = None,
        min_start: int = 1,
        starts: list[int] | None = None,
        inputs: Literal["contribution", "down_out"] = "contribution",
        stream_weighted: bool = True,
        equations: Literal["full", "diagonal", "none"] = "full",
    ):
        """``starts`` restricts the per-start sums to some spans; ``inputs="down_out"`` regresses on
        the down-projection output before a post-MLP norm instead of the MLP contribution;
        ``stream_weighted`` also accumulates the sums weighted per token by 1/‖h[start+length]‖²."""
        self.num_layers = num_layers
        self.max_length = max_length
        self.fit_length = fit_length
        self.min_start = min_start
        self.inputs = inputs
        self.stream_weighted = stream_weighted
        self.equations = equations
        shape = (num_layers + 1, max_length + 1)
        self.angular_all = np.zeros(shape)
        self.angular_last = np.zeros(shape)
        self.cosine_all = np.zeros(shape)
        self.tokens = 0
        self.sequences = 0
        self.fit_starts = (starts if starts is not None else list(range(min_start, num_layers - fit_length + 1))) if fit_length else []
        # without distances, the pass can stop after the deepest span it fits
        self.last_layer = num_layers - 1 if max_length else max(self.fit_starts) + fit_length - 1
        self._xtx: dict[int, torch.Tensor] = {}
        self._xty: dict[int, torch.Tensor] = {}
        self._yty = {i: 0.0 for i in self.fit_starts}
        self._identity_error = {i: 0.0 for i in self.fit_starts}
        self._weighted: dict[int, dict] = {}  # start → {"xtx", "xty", "yty", "identity"}
        self._hidden: dict[int, torch.Tensor] = {}  # boundary → residual stream (activations' dtype)
        self._unit: dict[int, torch.Tensor] = {}  # boundary → its rows at unit length (float64), for distances
        self._x: dict[int, torch.Tensor] = {}  # block before a candidate → the map's input
        self._contribution: dict[int, torch.Tensor] = {}  # the same block's MLP contribution, when x differs

    # -- memory ---------------------------------------------------------------------------
    def window_bytes_per_token(self, hidden_size: int, element: int = 4) -> int:
        """Bytes per token of the layers kept within a group, at ``element`` bytes per value (the
        activations' dtype), their float64 working copies and the distances' unit rows included."""
        boundaries = max(self.max_length, self.fit_length or 0) + 1
        open_inputs = min(self.fit_length or 0, len(self.fit_starts)) * (2 if self.inputs == "down_out" else 1)
        unit_rows = self.max_length + 1 if self.max_length else 0
        return (boundaries + open_inputs) * hidden_size * element + (6 + unit_rows) * hidden_size * 8

    @staticmethod
    def sums_bytes_for(starts: int, hidden_size: int, equations: str = "full", stream_weighted: bool = True) -> int:
        """Bytes of the per-start sums: 2 (or 4 with the weighted ones) d×d float64 matrices per start for
        ``full``, d-vectors for ``diagonal``, scalars for ``none``."""
        per_matrix = {"full": hidden_size * hidden_size, "diagonal": hidden_size, "none": 0}[equations] * 8
        return starts * per_matrix * (4 if stream_weighted else 2)

    def sums_bytes(self, hidden_size: int) -> int:
        return self.sums_bytes_for(len(self.fit_starts), hidden_size, self.equations, self.stream_weighted)

    # -- streaming ------------------------------------------------------------------------
    def on_layer(self, acts: LayerActivations) -> None:
        j = acts.index
        if j == 0:
            self._hidden[0] = acts.block_in
            self.tokens += acts.block_in.shape[0]
            self.sequences += acts.last_token.numel()
        current = acts.block_out
        self._hidden[j + 1] = current
        if self.max_length:
            if j == 0:
                self._unit[0] = _unit_rows(acts.block_in)
            unit = self._unit[j + 1] = _unit_rows(current)
            for length in range(1, self.max_length + 1):
                start = j + 1 - length
                if start >= 0:
                    self._add_distance(start, length, self._unit[start], unit, acts.last_token)
            self._unit.pop(j + 1 - self.max_length, None)  # no later span starts there
        if (j + 1) in self._yty:  # block j precedes a candidate span starting at j + 1
            self._x[j] = acts.down_out if self.inputs == "down_out" else acts.mlp_contribution
            if self.inputs == "down_out":
                self._contribution[j] = acts.mlp_contribution
            x = self._x[j].double()
            if self.equations == "full":
                add_sum(self._xtx, j + 1, x.T @ x)
            elif self.equations == "diagonal":
                add_sum(self._xtx, j + 1, (x * x).sum(0))
        start = j + 1 - (self.fit_length or 0)
        if self.fit_length and start in self._yty:
            self._add_fit(start, current)
        keep = max(self.max_length, self.fit_length or 0)
        self._hidden.pop(j + 1 - keep, None)

    def _add_fit(self, start: int, current: torch.Tensor) -> None:
        """Block ``start + fit_length - 1`` just produced ``current = h[start + fit_length]``: add the
        sums pairing it with the map's input from block ``start - 1``."""
        x = self._x.pop(start - 1).double()
        contribution = self._contribution.pop(start - 1).double() if self.inputs == "down_out" else x
        attn = self._hidden[start].double() - contribution  # block start-1's residual after its attention
        target = current.double()
        y = target - attn
        self._yty[start] += float((y * y).sum())
        self._identity_error[start] += float(((contribution - y) ** 2).sum())
        weight = 1.0 / target.pow(2).sum(-1, keepdim=True).clamp(min=1e-30) if self.stream_weighted else None
        if self.equations == "full":
            add_sum(self._xty, start, x.T @ y)
        elif self.equations == "diagonal":
            add_sum(self._xty, start, (x * y).sum(0))
        if weight is not None:
            wx = weight * x
            sums = {"yty": (weight * y * y).sum(), "identity": (weight * (contribution - y) ** 2).sum()}
            if self.equations == "full":
                sums.update(xtx=wx.T @ x, xty=wx.T @ y)
            elif self.equations == "diagonal":
                sums.update(xtx=(wx * x).sum(0), xty=(wx * y).sum(0))
            add_sums(self._weighted.setdefault(start, {}), sums)

    def end_batch(self) -> None:
        self._hidden.clear()
        self._unit.clear()
        self._x.clear()
        self._contribution.clear()

    def _add_distance(self, start, length, before, after, last_token) -> None:
        cos = (before * after).sum(-1).clamp(-1, 1)
        angle = torch.arccos(cos) / math.pi
        self.angular_all[start, length] += float(angle.sum())
        self.cosine_all[start, length] += float(cos.sum())
        self.angular_last[start, length] += float(angle[last_token].sum())

    # -- combining and reading ------------------------------------------------------------
    def merge(self, other: "SpanStatistics") -> "SpanStatistics":
        """Add another shard's sums (same model, same lengths) into this one."""
        for name in ("angular_all", "angular_last", "cosine_all"):
            getattr(self, name).__iadd__(getattr(other, name))
        self.tokens += other.tokens
        self.sequences += other.sequences
        for key in self.fit_starts:
            for store, theirs in ((self._xtx, other._xtx), (self._xty, other._xty)):
                if key in theirs:
                    add_sum(store, key, theirs[key])
            self._yty[key] += other._yty[key]
            self._identity_error[key] += other._identity_error[key]
            if key in other._weighted:
                add_sums(self._weighted.setdefault(key, {}), other._weighted[key])
        return self

    def finalize(self) -> SpanTable:
        valid = np.full_like(self.angular_all, np.nan)
        for start in range(self.num_layers + 1):
            for length in range(1, self.max_length + 1):
                if start + length <= self.num_layers:
                    valid[start, length] = 1.0
        tokens, seqs = max(self.tokens, 1), max(self.sequences, 1)
        full = self.equations == "full"
        equations = {
            i: NormalEquations(self._xtx.get(i) if full else None, self._xty.get(i) if full else None,
                               self._yty[i], self._identity_error[i], self.tokens)
            for i in self.fit_starts if self.equations == "none" or i in self._xty
        }
        weighted = {
            i: NormalEquations(w.get("xtx") if full else None, w.get("xty") if full else None, float(w["yty"]),
                               float(w["identity"]), self.tokens)
            for i, w in self._weighted.items()
        }
        screened = [i for i in self.fit_starts if i in self._xty] if self.equations == "diagonal" else []
        screening = {i: self._diagonal_error(i) for i in screened}
        stream_screening = {i: self._diagonal_stream_error(i) for i in screened} if self.stream_weighted else {}
        return SpanTable(
            angular_all=self.angular_all / tokens * valid,
            angular_last=self.angular_last / seqs * valid,
            cosine_all=self.cosine_all / tokens * valid,
            normal_equations=equations,
            stream_weighted_equations=weighted,
            fit_length=self.fit_length or 0,
            tokens=self.tokens,
            diagonal_fit_error=screening,
            diagonal_fit_error_stream=stream_screening,
        )

    def _diagonal_scale(self, start: int):
        """The best per-channel scale (the diagonal map), from the diagonals of the sums alone."""
        return self._xty[start] / self._xtx[start].clamp(min=1e-300)

    def _diagonal_error(self, start: int) -> float:
        """``fit_error`` of the diagonal map: a cheap stand-in for the full map's, to screen with."""
        scale = self._diagonal_scale(start)
        error = self._yty[start] - float((scale * self._xty[start]).sum())
        return error / max(self._yty[start], 1e-300)

    def _diagonal_stream_error(self, start: int) -> float:
        """``fit_error_stream`` of the diagonal map: a cheap stand-in for the full map's."""
        scale = self._diagonal_scale(start)
        weighted = self._weighted[start]
        error = (scale * scale * weighted["xtx"]).sum() - 2 * (scale * weighted["xty"]).sum() + weighted["yty"]
        return float(error) / max(self.tokens, 1)
