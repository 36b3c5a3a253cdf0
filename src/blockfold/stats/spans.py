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
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from blockfold.stats.engine import LayerActivations
from blockfold.stats.sums import add_sum, add_sums


@dataclass
class NormalEquations:
    """Sums for ``min_T ‖X T − Y‖²``; ``tokens`` rows went into them."""

    xtx: torch.Tensor  # (d, d) float64
    xty: torch.Tensor  # (d, d) float64
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

    def criterion(self, name: str) -> np.ndarray:
        return {"angular_all": self.angular_all, "angular_last": self.angular_last}[name]


def _unit_rows(hidden: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit length in float64, so each span's cosine is one row-wise dot product."""
    hidden = hidden.double()
    return hidden / hidden.norm(dim=-1, keepdim=True).clamp(min=1e-30)


class SpanStatistics:
    """Observer: distances of all spans up to ``max_length`` and normal equations at ``fit_length``."""

    def __init__(
        self,
        num_layers: int,
        max_length: int,
        fit_length: int | None = None,
        min_start: int = 1,
        starts: list[int] | None = None,
        inputs: Literal["contribution", "down_out"] = "contribution",
        stream_weighted: bool = True,
    ):
        """``starts`` restricts the normal equations to some spans; ``inputs="down_out"`` regresses on
        the down-projection output before a post-MLP norm instead of the MLP contribution;
        ``stream_weighted`` also accumulates the per-token weighted sums (two more (d, d) per start)."""
        self.num_layers = num_layers
        self.max_length = max_length
        self.fit_length = fit_length
        self.min_start = min_start
        self.inputs = inputs
        self.stream_weighted = stream_weighted
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
        self._hidden: dict[int, torch.Tensor] = {}
        self._x: dict[int, torch.Tensor] = {}
        self._attn: dict[int, torch.Tensor] = {}
        self._contribution: dict[int, torch.Tensor] = {}

    # -- streaming ------------------------------------------------------------------------
    def on_layer(self, acts: LayerActivations) -> None:
        j = acts.index
        if j == 0:
            self._hidden[0] = _unit_rows(acts.block_in)
            self.tokens += acts.block_in.shape[0]
            self.sequences += acts.last_token.numel()
        current = acts.block_out
        self._hidden[j + 1] = unit = _unit_rows(current)
        for length in range(1, self.max_length + 1):
            start = j + 1 - length
            if start >= 0:
                self._add_distance(start, length, self._hidden[start], unit, acts.last_token)
        if (j + 1) in self._yty:  # block j precedes a candidate span starting at j + 1
            contribution = acts.mlp_contribution.double()
            x = acts.down_out.double() if self.inputs == "down_out" else contribution
            self._x[j], self._attn[j] = x, acts.block_out.double() - contribution  # residual after attention
            self._contribution[j] = contribution
            add_sum(self._xtx, j + 1, x.T @ x)
        start = j + 1 - (self.fit_length or 0)
        if self.fit_length and start in self._yty:
            x, y = self._x.pop(start - 1), current.double() - self._attn.pop(start - 1)
            contribution = self._contribution.pop(start - 1)
            add_sum(self._xty, start, x.T @ y)
            self._yty[start] += float((y * y).sum())
            self._identity_error[start] += float(((contribution - y) ** 2).sum())
            if self.stream_weighted:
                weight = 1.0 / current.double().pow(2).sum(-1, keepdim=True).clamp(min=1e-30)
                wx = weight * x
                add_sums(self._weighted.setdefault(start, {}), {
                    "xtx": wx.T @ x, "xty": wx.T @ y, "yty": (weight * y * y).sum(),
                    "identity": (weight * (contribution - y) ** 2).sum(),
                })
        if self.max_length:
            self._hidden.pop(j + 1 - self.max_length, None)
        else:
            self._hidden.clear()

    def end_batch(self) -> None:
        self._hidden.clear()
        self._x.clear()
        self._attn.clear()
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
        equations = {
            i: NormalEquations(self._xtx[i], self._xty[i], self._yty[i], self._identity_error[i], self.tokens)
            for i in self.fit_starts
            if i in self._xty
        }
        weighted = {
            i: NormalEquations(w["xtx"], w["xty"], float(w["yty"]), float(w["identity"]), self.tokens)
            for i, w in self._weighted.items()
        }
        return SpanTable(
            angular_all=self.angular_all / tokens * valid,
            angular_last=self.angular_last / seqs * valid,
            cosine_all=self.cosine_all / tokens * valid,
            normal_equations=equations,
            stream_weighted_equations=weighted,
            fit_length=self.fit_length or 0,
            tokens=self.tokens,
        )
