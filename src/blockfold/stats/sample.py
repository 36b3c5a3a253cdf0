"""A bounded random subsample of the rows one span's numerical fit needs."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from blockfold.stats.activations import LayerActivations


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

    def to(self, device: torch.device) -> "SpanRows":
        return SpanRows(self.x.to(device), self.attn_residual.to(device), self.target.to(device))


class TokenSampler:
    """Keeps each calibration token with probability ``max_tokens / total_tokens``, decided once per
    token by its place in the calibration set: the same tokens are kept however a pipeline groups
    the sequences (batches, or chunks run layer by layer), as long as it keeps their order."""

    def __init__(self, max_tokens: int, total_tokens: int, seed: int = 0, excluding: "TokenSampler | None" = None):
        """``excluding``: keep ``max_tokens`` of the tokens that sampler does not keep, chosen at random
        (a held-out sample, disjoint from a fit's, whatever the two seeds)."""
        generator = torch.Generator().manual_seed(seed)
        if excluding is None:
            probability = min(1.0, max_tokens / max(total_tokens, 1))
            self._decisions = torch.rand(total_tokens, generator=generator) < probability
        else:
            order = torch.randperm(total_tokens, generator=generator)
            self._decisions = torch.zeros(total_tokens, dtype=torch.bool)
            self._decisions[order[~excluding._decisions[order]][:max_tokens]] = True
        self._seen = 0

    def next(self, count: int, device: torch.device) -> torch.Tensor:
        """Keep-mask of the next ``count`` tokens (tokens beyond the announced total are not kept)."""
        mask = torch.zeros(count, dtype=torch.bool)
        taken = self._decisions[self._seen : self._seen + count]
        mask[: len(taken)] = taken
        self._seen += count
        return mask.to(device)

    def skip(self, count: int) -> None:
        self._seen += count

    def describe(self) -> dict:
        """Which tokens it keeps (the decisions' hash), for the key of a saved pass."""
        return {"keeps": hashlib.sha256(self._decisions.numpy().tobytes()).hexdigest()[:16]}


class SpanSample:
    """Observer: the rows of a random subset of tokens (at most ``max_tokens``) for one span's numerical fit."""

    SUMS = ()
    ROWS = ("_rows",)

    def __init__(self, start: int, length: int, max_tokens: int, total_tokens: int, pre_norm: bool, seed: int = 0,
                 held_out_from: "SpanSample | None" = None):
        """``held_out_from``: sample only tokens that sample does not hold, to compare fits made on it."""
        self.start, self.length = start, length
        self.last_layer = start + length - 1
        self.max_tokens = max_tokens
        self.pre_norm = pre_norm
        self.sampler = TokenSampler(max_tokens, total_tokens, seed,
                                    excluding=None if held_out_from is None else held_out_from.sampler)
        self._keep: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def on_layer(self, acts: LayerActivations) -> None:
        if acts.index == self.start - 1:
            self._keep = self.sampler.next(acts.block_out.shape[0], acts.block_out.device)
            x = acts.down_out if self.pre_norm else acts.mlp_contribution
            self._pending = (x[self._keep].float().cpu(), acts.attn_residual[self._keep].cpu())
        elif acts.index == self.last_layer and self._pending is not None:
            x, attn = self._pending
            self._rows.append((x, attn, acts.block_out[self._keep].float().cpu()))

    def end_batch(self) -> None:
        self._keep, self._pending = None, None

    def skip(self, tokens: int) -> None:
        """The next ``tokens`` calibration tokens are observed elsewhere (another process, a checkpoint)."""
        self.sampler.skip(tokens)

    def window_bytes_per_token(self, hidden_size: int, element: int = 4) -> int:
        return 0  # only sampled rows are kept, at most max_tokens of them

    def sums_bytes(self, hidden_size: int) -> int:
        return 3 * self.max_tokens * hidden_size * 4

    def has_rows(self) -> bool:
        """False when no token was kept (a held-out sample of a calibration set the fit sample took whole)."""
        return any(len(x) for x, _, _ in self._rows)

    def rows(self) -> SpanRows:
        x, attn, target = (torch.cat(parts)[: self.max_tokens] for parts in zip(*self._rows))
        return SpanRows(x, attn, target)
