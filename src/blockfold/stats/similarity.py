"""Second moments of the residual stream at every layer boundary, and between boundaries a fixed
number of blocks apart, for representation-similarity criteria (linear CKA, CCA) of spans.

``h[k]`` is the stream entering block ``k`` (``h[L]`` leaves the last block). For every boundary the
observer keeps ``Σh``, ``Σhhᵀ``; for every span ``(start, length)`` with ``length`` in ``lengths``,
``Σ h[start+length] h[start]ᵀ``. Raw float64 sums, centred in ``finalize`` (as in
``stats/linearity.py``), so shards merge by addition. Memory: ``(L + 1) + L·len(lengths)`` matrices
of (d, d) float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockfold.errors import BlockfoldError
from blockfold.stats.activations import LayerActivations
from blockfold.stats.linearity import LinearStatistics
from blockfold.stats.sample import TokenSampler
from blockfold.stats.sums import add_sum


@dataclass
class StreamMoments:
    """Centred moments of the residual stream at the boundaries; ``pair`` gives those of one span."""

    means: list[torch.Tensor]
    covariances: list[torch.Tensor]
    cross: dict[tuple[int, int], torch.Tensor]  # (start, length) → Cov(h[start+length], h[start])
    tokens: int

    def pair(self, start: int, length: int) -> LinearStatistics:
        """Moments of ``x = h[start]`` and ``y = h[start+length]``."""
        if (start, length) not in self.cross:
            raise BlockfoldError(f"no cross-moments for the span ({start}, {length}): add {length} to the observer's lengths")
        end = start + length
        return LinearStatistics(
            mean_x=self.means[start], mean_y=self.means[end], cov_xx=self.covariances[start],
            cov_yy=self.covariances[end], cov_yx=self.cross[(start, length)], tokens=self.tokens,
            mean_cosine=float("nan"), stream_weighted={},
        )


class StreamSimilarity:
    """Observer: moments of ``h[k]`` for every boundary and of ``(h[s], h[s+ℓ])`` for ℓ in ``lengths``."""

    SUMS = ("tokens", "_sum", "_gram", "_cross")
    ROWS = ()

    def __init__(self, num_layers: int, lengths: list[int]):
        self.num_layers = num_layers
        self.lengths = sorted(set(lengths))
        self.last_layer = num_layers - 1
        self.tokens = 0
        self._sum: dict[int, torch.Tensor] = {}
        self._gram: dict[int, torch.Tensor] = {}
        self._cross: dict[tuple[int, int], torch.Tensor] = {}
        self._window: dict[int, torch.Tensor] = {}

    @staticmethod
    def sums_bytes_for(num_layers: int, lengths: int, hidden_size: int) -> int:
        """(L + 1) Gram matrices and one cross matrix per start and length, d×d float64."""
        return (num_layers + 1 + num_layers * lengths) * hidden_size * hidden_size * 8

    def sums_bytes(self, hidden_size: int) -> int:
        return self.sums_bytes_for(self.num_layers, len(self.lengths), hidden_size)

    def window_bytes_per_token(self, hidden_size: int, element: int = 4) -> int:
        return (max(self.lengths, default=0) + 1) * hidden_size * element + 2 * hidden_size * 8

    def on_layer(self, acts: LayerActivations) -> None:
        if acts.index == 0:
            self.tokens += acts.block_in.shape[0]
            self._add_boundary(0, acts.block_in)
        self._add_boundary(acts.index + 1, acts.block_out)

    def _add_boundary(self, k: int, hidden: torch.Tensor) -> None:
        h = hidden.double()
        add_sum(self._sum, k, h.sum(0))
        add_sum(self._gram, k, h.T @ h)
        for length in self.lengths:
            if k - length in self._window:
                add_sum(self._cross, (k - length, length), h.T @ self._window[k - length].double())
        self._window[k] = hidden  # float32: the window is the observer's per-token memory
        self._window.pop(k - max(self.lengths, default=0), None)

    def end_batch(self) -> None:
        self._window.clear()

    def merge(self, other: "StreamSimilarity") -> "StreamSimilarity":
        if (other.num_layers, other.lengths) != (self.num_layers, self.lengths):
            raise BlockfoldError("cannot merge stream moments of different models or span lengths: merge shards of one pass")
        self.tokens += other.tokens
        for mine, theirs in ((self._sum, other._sum), (self._gram, other._gram), (self._cross, other._cross)):
            for key, value in theirs.items():
                add_sum(mine, key, value)
        return self

    def finalize(self) -> StreamMoments:
        if self.tokens == 0:
            raise BlockfoldError("no calibration tokens were streamed: stream some batches before finalize")
        n = self.tokens
        means = [self._sum[k] / n for k in range(self.num_layers + 1)]
        covariances = [self._gram[k] / n - torch.outer(means[k], means[k]) for k in range(self.num_layers + 1)]
        cross = {(s, length): value / n - torch.outer(means[s + length], means[s])
                 for (s, length), value in self._cross.items()}
        return StreamMoments(means, covariances, cross, n)


class StreamSubsample:
    """Observer: the residual stream at every boundary for a fixed random subset of tokens (at most
    ``max_tokens``, the same tokens at every boundary), for measures that need whole pairs of
    layers (CKA between all layer pairs) without (L+1)² cross-moment matrices."""

    SUMS = ()
    ROWS = ("_rows",)

    def __init__(self, num_layers: int, max_tokens: int, total_tokens: int, seed: int = 0):
        self.num_layers = num_layers
        self.last_layer = num_layers - 1
        self.max_tokens = max_tokens
        self.sampler = TokenSampler(max_tokens, total_tokens, seed)
        self._keep: torch.Tensor | None = None
        self._rows: dict[int, list[torch.Tensor]] = {k: [] for k in range(num_layers + 1)}

    def window_bytes_per_token(self, hidden_size: int, element: int = 4) -> int:
        return 0

    def sums_bytes(self, hidden_size: int) -> int:
        return (self.num_layers + 1) * self.max_tokens * hidden_size * 4

    def on_layer(self, acts: LayerActivations) -> None:
        if acts.index == 0:
            self._keep = self.sampler.next(acts.block_in.shape[0], acts.block_in.device)
            self._rows[0].append(acts.block_in[self._keep].float().cpu())
        self._rows[acts.index + 1].append(acts.block_out[self._keep].float().cpu())

    def end_batch(self) -> None:
        self._keep = None

    def skip(self, tokens: int) -> None:
        """The next ``tokens`` calibration tokens are observed elsewhere (another process, a checkpoint)."""
        self.sampler.skip(tokens)

    def hidden(self) -> list[torch.Tensor]:
        """``[h[0], ..., h[L]]``, each (tokens, d) for the same sampled tokens."""
        return [torch.cat(rows)[: self.max_tokens] for rows in self._rows.values()]


def pairwise_linear_cka(hidden: list[torch.Tensor]) -> torch.Tensor:
    """Linear CKA between every pair of boundaries from token rows, in the kernel form
    ``⟨K_i, K_j⟩ / (‖K_i‖ ‖K_j‖)`` with centred Gram matrices ``K = X_c X_cᵀ`` (cheaper than d×d cross
    products for every pair when tokens < d·L)."""
    grams = []
    for h in hidden:
        h = h.double()
        centred = h - h.mean(0)
        gram = centred @ centred.T
        grams.append(gram / gram.norm().clamp(min=1e-300))
    flat = torch.stack([g.reshape(-1) for g in grams])
    return flat @ flat.T
