"""First and second moments of what a sublayer reads and adds, per layer, for Neural Block
Linearization (NBL): replace a sublayer by the linear map that best predicts its output from its input.

For each layer the observer pairs an input ``x`` with a contribution ``y``:

* ``target="attention"``: ``x`` is the normalised hidden state the attention reads, ``y`` what the
  attention adds to the residual stream (after a post-attention norm, where the block has one);
* ``target="block"``: ``x`` is the residual stream entering the block, ``y = block_out - block_in``.

``y`` is the contribution, never the residual after it (``x + y`` for blocks): the residual contains
``x`` itself, so its canonical correlations with ``x`` would be near 1 for every layer and rank
nothing. The replacement is ``residual + x Wᵀ + b`` either way, so nothing is lost by this choice.

Alongside, the mean cosine similarity between the residual stream before and after the sublayer
(``block_in`` vs ``block_in + y``) is kept for the DROP criterion, and the same moments weighted per
token by ``1 / ‖block_in + y‖²``, to put the linear map's error on the scale of the residual stream it
perturbs, token by token (an unweighted ratio would be dominated by the few tokens with massive
activations). Memory: five (d, d) float64 matrices per layer.

Numerics: raw sums (count, Σx, Σy, ΣxxT, ΣyyT, ΣyxT) are accumulated in float64 and centred only in
``finalize`` as ``E[xyᵀ] − μ_x μ_yᵀ``. Raw sums make shards merge by plain addition; the cancellation
costs about log10(μ²/σ²) of float64's ~16 digits, far more than the float32 activations carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from blockfold.errors import BlockfoldError
from blockfold.stats.activations import LayerActivations
from blockfold.stats.sums import add_sums

TARGETS = ("attention", "block")


@dataclass
class LinearStatistics:
    """Means and centred (1/n) covariances of one layer's input ``x`` and contribution ``y``, float64."""

    mean_x: torch.Tensor  # (d_in,)
    mean_y: torch.Tensor  # (d_out,)
    cov_xx: torch.Tensor  # (d_in, d_in)
    cov_yy: torch.Tensor  # (d_out, d_out)
    cov_yx: torch.Tensor  # (d_out, d_in)
    tokens: int
    mean_cosine: float  # mean cosine between the residual stream before and after the sublayer
    # means of raw moments weighted per token by w = 1 / ‖h + y‖², the inverse squared norm of the
    # residual stream after the sublayer: keys "w", "wx", "wy", "wxx", "wyx", "wyy" (the last a trace)
    stream_weighted: dict[str, torch.Tensor]

    def relative_stream_error(self, weight: torch.Tensor, bias: torch.Tensor) -> float:
        """``mean_t ‖y_t − W x_t − b‖² / ‖h_t + y_t‖²``: how much replacing the sublayer by ``(W, b)``
        perturbs the residual stream, relative to its size at each token, from the moments alone."""
        w, b, m = weight.double(), bias.double(), self.stream_weighted
        error = (m["wyy"] - 2 * (w * m["wyx"]).sum() - 2 * b @ m["wy"] + (w * (w @ m["wxx"])).sum()
                 + 2 * b @ (w @ m["wx"]) + m["w"] * (b @ b))
        return float(error)

    def relative_residual(self, weight: torch.Tensor) -> float:
        """``E‖y − ŷ‖² / Tr C_yy`` of ``ŷ = W x + b`` with the best ``b``, from the moments alone."""
        w = weight.double()
        total = self.cov_yy.trace()
        error = total - 2 * (w * self.cov_yx).sum() + (w * (w @ self.cov_xx)).sum()
        return float(error / total)


class SublayerLinearity:
    """Observer: per-layer moments of (sublayer input, sublayer contribution), for every layer or for
    ``layers``; with ``moments=False`` only the cosine between the residual stream before and after
    (DROP's criterion: scalars, no d×d sums)."""

    SUMS = ("tokens", "cosine_sum", "_sums")
    ROWS = ()

    def __init__(self, num_layers: int, target: Literal["attention", "block"], layers: list[int] | None = None,
                 moments: bool = True):
        if target not in TARGETS:
            raise BlockfoldError(f"unknown linearity target {target!r}: use one of {', '.join(TARGETS)}")
        self.num_layers = num_layers
        self.target = target
        self.layers = sorted(layers) if layers is not None else list(range(num_layers))
        self.moments = moments
        self.last_layer = max(self.layers)
        self.needs_attention = target == "attention"
        self.tokens = [0] * num_layers
        self.cosine_sum = [0.0] * num_layers
        self._sums: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]

    # -- memory ---------------------------------------------------------------------------
    @staticmethod
    def sums_bytes_for(num_layers: int, hidden_size: int) -> int:
        """Five d×d float64 matrices per layer (xx, yy, yx and the weighted xx, yx)."""
        return num_layers * 5 * hidden_size * hidden_size * 8

    def sums_bytes(self, hidden_size: int) -> int:
        return self.sums_bytes_for(len(self.layers), hidden_size) if self.moments else 0

    def window_bytes_per_token(self, hidden_size: int, element: int = 4) -> int:
        """Nothing is kept between layers; the float64 working copies of one layer's rows."""
        return 6 * hidden_size * 8

    # -- streaming ------------------------------------------------------------------------
    def on_layer(self, acts: LayerActivations) -> None:
        if acts.index not in self.layers:
            return
        residual = acts.block_in.double()
        if self.target == "attention":
            x, y = acts.attn_input.double(), acts.attn_contribution.double()
        else:
            x, y = residual, acts.block_out.double() - residual
        index = acts.index
        self.tokens[index] += x.shape[0]
        self.cosine_sum[index] += float(F.cosine_similarity(residual, residual + y, dim=-1).sum())
        if not self.moments:
            return
        weight = 1.0 / (residual + y).pow(2).sum(-1).clamp(min=1e-30)
        wx, wy = weight[:, None] * x, weight[:, None] * y
        add_sums(self._sums[index], {"x": x.sum(0), "y": y.sum(0), "xx": x.T @ x, "yy": y.T @ y, "yx": y.T @ x,
                                     "w": weight.sum(), "wx": wx.sum(0), "wy": wy.sum(0), "wxx": wx.T @ x,
                                     "wyx": wy.T @ x, "wyy": (wy * y).sum()})

    def end_batch(self) -> None:
        """Nothing is carried from one layer to the next."""

    # -- combining and reading ------------------------------------------------------------
    def merge(self, other: "SublayerLinearity") -> "SublayerLinearity":
        """Add another shard's sums (same model, same target) into this one."""
        if (other.num_layers, other.target) != (self.num_layers, self.target):
            raise BlockfoldError(
                f"cannot merge {other.target} statistics of {other.num_layers} layers into "
                f"{self.target} statistics of {self.num_layers} layers: merge shards of one pass only"
            )
        for index in range(self.num_layers):
            self.tokens[index] += other.tokens[index]
            self.cosine_sum[index] += other.cosine_sum[index]
            add_sums(self._sums[index], other._sums[index])
        return self

    def finalize(self) -> list[LinearStatistics]:
        """Every layer's statistics (an observer of all layers, with moments)."""
        return [self._layer_statistics(index) for index in range(self.num_layers)]

    def measured(self) -> dict[int, LinearStatistics]:
        """The statistics of the layers this observer accumulated moments for."""
        return {index: self._layer_statistics(index) for index in self.layers}

    def mean_cosines(self) -> dict[int, float]:
        """Per observed layer, the mean cosine between the residual stream before and after it."""
        return {index: self.cosine_sum[index] / max(self.tokens[index], 1) for index in self.layers}

    def _layer_statistics(self, index: int) -> LinearStatistics:
        n = self.tokens[index]
        if n == 0:
            raise BlockfoldError(f"layer {index} saw no calibration tokens: stream some batches before finalize")
        moment = {name: value / n for name, value in self._sums[index].items()}
        mean_x, mean_y = moment["x"], moment["y"]
        return LinearStatistics(
            mean_x=mean_x,
            mean_y=mean_y,
            cov_xx=moment["xx"] - torch.outer(mean_x, mean_x),
            cov_yy=moment["yy"] - torch.outer(mean_y, mean_y),
            cov_yx=moment["yx"] - torch.outer(mean_y, mean_x),
            tokens=n,
            mean_cosine=self.cosine_sum[index] / n,
            stream_weighted={name: moment[name] for name in ("w", "wx", "wy", "wxx", "wyx", "wyy")},
        )
