"""A bounded random subsample of the rows one span's numerical fit needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockfold.stats.engine import LayerActivations


@dataclass
class SpanRows:
    """Rows for fitting the map that replaces one span.

    ``x`` is the input of the map (the MLP contribution of the block before the span, or for
    sandwich blocks the down-projection output before the post-MLP norm), ``attn_residual`` the
    residual after that block's attention, ``target`` the residual stream after the span.
    """

    x: torch.Tensor
    attn_residual: torch.Tensor
    target: torch.Tensor


class SpanSample:
    """Observer: keeps each real token with probability ``max_tokens / total_tokens`` (at most ``max_tokens``)."""

    def __init__(self, start: int, length: int, max_tokens: int, total_tokens: int, pre_norm: bool, seed: int = 0):
        self.start, self.length = start, length
        self.last_layer = start + length - 1
        self.keep_probability = min(1.0, max_tokens / max(total_tokens, 1))
        self.max_tokens = max_tokens
        self.pre_norm = pre_norm
        self.generator = torch.Generator().manual_seed(seed)
        self._keep: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def on_layer(self, acts: LayerActivations) -> None:
        if acts.index == self.start - 1:
            n = acts.block_out.shape[0]
            self._keep = (torch.rand(n, generator=self.generator) < self.keep_probability).to(acts.block_out.device)
            x = acts.down_out if self.pre_norm else acts.mlp_contribution
            self._pending = (x[self._keep].cpu(), acts.attn_residual[self._keep].cpu())
        elif acts.index == self.last_layer and self._pending is not None:
            x, attn = self._pending
            self._rows.append((x, attn, acts.block_out[self._keep].cpu()))

    def end_batch(self) -> None:
        self._keep, self._pending = None, None

    def rows(self) -> SpanRows:
        x, attn, target = (torch.cat(parts)[: self.max_tokens] for parts in zip(*self._rows))
        return SpanRows(x, attn, target)
