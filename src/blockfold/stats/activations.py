"""What a pipeline hands an observer: one decoder layer's activations for a group of calibration
tokens, and the contract observers follow (``on_layer`` per layer, in order; ``end_batch`` after the
group's last layer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class LayerActivations:
    """What one decoder layer read and wrote for the real (non-padding) tokens of a group of
    sequences, as (tokens, d) rows in the model's dtype on the device the model runs on."""

    index: int
    block_in: torch.Tensor
    block_out: torch.Tensor
    mlp_contribution: torch.Tensor  # exactly what the MLP half adds to the residual stream
    down_out: torch.Tensor | None  # down_proj output before a post-MLP norm (sandwich blocks only)
    last_token: torch.Tensor  # row index of each sequence's last real token
    # captured only when an observer sets ``needs_attention``:
    attn_input: torch.Tensor | None = None  # the normalised hidden state the attention reads
    attn_contribution: torch.Tensor | None = None  # exactly what the attention half adds to the residual
    # captured only when an observer sets ``needs_projection_inputs``: what each linear projection of
    # the block reads (adapter.linear_projections' names; projections fed one tensor share its rows)
    projection_inputs: dict[str, torch.Tensor] | None = None

    @property
    def attn_residual(self) -> torch.Tensor:
        """The residual stream after the attention half, before the MLP adds to it (float32 at least)."""
        return self.block_out.float() - self.mlp_contribution.float()


class Observer(Protocol):
    """Folds activations into float64 sums. A pipeline calls ``on_layer`` for layers 0..``last_layer``
    of one group of sequences (a batch, or a chunk of batches run layer by layer), in order, then
    ``end_batch``; an observer may keep a window of recent layers within a group, never across groups,
    so it works the same whichever pipeline runs it and however the calibration set is grouped."""

    #: deepest layer index whose activations the observer reads
    last_layer: int
    #: optional attribute: True to also capture the attention sublayer's input and contribution
    #: needs_attention: bool
    #: optional attribute: True to also capture what every linear projection of the block reads
    #: needs_projection_inputs: bool

    def on_layer(self, acts: LayerActivations) -> None: ...

    def end_batch(self) -> None: ...
