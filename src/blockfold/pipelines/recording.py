"""The residual stream of a pass, kept at chosen depths, so that a later stage which needs the unedited
model's stream (the downstream refit) reads it instead of running the model again.

A ``StreamRecorder`` rides along a pass beside the observers (``Runner.run(..., recorders=[...])``) but
is not a statistic: it is never reduced across processes, cached or checkpointed. Each process keeps
the stream of its own shard, which is the shard its later stages run on. A pass loaded from the
statistics cache, or resumed part way, leaves it incomplete, and the stage then runs its own pass.
"""

from __future__ import annotations

import torch

from blockfold.data import Batch
from blockfold.pipelines.buffers import ActivationStore
from blockfold.stats.activations import LayerActivations


class StreamRecorder:
    """The stream at ``depths`` for the real tokens of every group of one pass: depth ``i`` is what block
    ``i`` reads, and ``last_layer + 1`` what the last observed block writes. Kept in ``store``."""

    def __init__(self, depths: set[int], store: ActivationStore):
        self.depths, self.store = set(depths), store
        self.last_layer = max(self.depths) - 1 if max(self.depths) > 0 else 0
        self._group = 0
        self._tokens = 0

    def on_layer(self, acts: LayerActivations) -> None:
        if acts.index in self.depths:
            self.store.put((acts.index, self._group), acts.block_in)
        if acts.index == self.last_layer and acts.index + 1 in self.depths:
            self.store.put((acts.index + 1, self._group), acts.block_out)
        if acts.index == 0:
            self._tokens += acts.block_in.shape[0]

    def end_batch(self) -> None:
        self._group += 1

    def covers(self, batches: list[Batch], depths: set[int]) -> bool:
        """Whether this recording holds ``depths`` for exactly the real tokens of ``batches``, in order
        (the pass ran over them from the first group: not loaded from a cache, not resumed)."""
        tokens = sum(int(batch.attention_mask.sum()) for batch in batches)
        return depths <= self.depths and self._group > 0 and self._tokens == tokens

    def stream(self, depth: int, batches: list[Batch]) -> list[torch.Tensor]:
        """The stream at ``depth`` per batch of ``batches``, shaped as the batch's hidden state (padding
        positions zero: every later fit reads the real tokens only, and masks keep padding out of them)."""
        rows = torch.cat([self.store.get((depth, group)) for group in range(self._group)])
        streams, start = [], 0
        for batch in batches:
            mask = batch.attention_mask.to(rows.device).bool()
            hidden = rows.new_zeros(*mask.shape, rows.shape[-1])
            count = int(mask.sum())
            hidden[mask] = rows[start : start + count]
            streams.append(hidden)
            start += count
        return streams

    def close(self) -> None:
        self.store.close()


__all__ = ["StreamRecorder"]
