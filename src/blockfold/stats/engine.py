"""The streaming calibration engine.

One forward pass per batch through the decoder (no LM head), with hooks at the points the adapter
names. As each decoder layer finishes, the engine hands its activations (padding removed) to every
observer, layer by layer, in order; observers fold them into float64 sums and keep at most a short
window of recent layers, so memory depends on the batch, never on the number of calibration tokens.
Because observers only ever see one layer at a time, the same observers work unchanged when layers
are executed one at a time (offloaded models), and the pass stops after the deepest layer any
observer needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from blockfold.adapters import DecoderAdapter
from blockfold.data import Batch


@dataclass
class LayerActivations:
    """What one decoder layer read and wrote for the real (non-padding) tokens of a batch, as (tokens, d)."""

    index: int
    block_in: torch.Tensor
    block_out: torch.Tensor
    mlp_contribution: torch.Tensor  # exactly what the MLP half adds to the residual stream
    down_out: torch.Tensor | None  # down_proj output before a post-MLP norm (sandwich blocks only)
    last_token: torch.Tensor  # row index of each sequence's last real token
    # captured only when an observer sets ``needs_attention``:
    attn_input: torch.Tensor | None = None  # the normalised hidden state the attention reads
    attn_contribution: torch.Tensor | None = None  # exactly what the attention half adds to the residual

    @property
    def attn_residual(self) -> torch.Tensor:
        """The residual stream after the attention half, before the MLP adds to it."""
        return self.block_out - self.mlp_contribution


class Observer(Protocol):
    #: deepest layer index whose activations the observer reads
    last_layer: int
    #: optional attribute: True to also capture the attention sublayer's input and contribution
    #: needs_attention: bool

    def on_layer(self, acts: LayerActivations) -> None: ...

    def end_batch(self) -> None: ...


class _StopForward(Exception):
    """Raised from a hook once every observer has what it needs from this batch."""


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def stream_activations(
    model: nn.Module,
    adapter: DecoderAdapter,
    batches: Iterable[Batch],
    observers: list[Observer],
    description: str = "calibration pass",
) -> None:
    """Run ``batches`` through the decoder once, feeding every layer's activations to ``observers``."""
    layers = adapter.layers(model)
    last_layer = max(obs.last_layer for obs in observers)
    device = next(model.parameters()).device
    state: dict = {}

    def flat(hidden: torch.Tensor) -> torch.Tensor:
        return hidden[state["mask"]].float()

    def capture_input(module, args, kwargs):
        state["block_in"] = flat(args[0] if args else kwargs["hidden_states"])

    def capture(key):
        def hook(module, args, output):
            state[key] = flat(_first(output))

        return hook

    def finish_layer(index):
        def hook(module, args, output):
            block_out = flat(_first(output))
            acts = LayerActivations(
                index=index,
                block_in=state.pop("block_in"),
                block_out=block_out,
                mlp_contribution=state.pop("mlp"),
                down_out=state.pop("down", None),
                last_token=state["last_token"],
                attn_input=state.pop("attn_in", None),
                attn_contribution=state.pop("attn", None),
            )
            for obs in observers:
                if index <= obs.last_layer:
                    obs.on_layer(acts)
            state["block_in"] = block_out
            if index == last_layer:
                raise _StopForward

        return hook

    needs_attention = any(getattr(obs, "needs_attention", False) for obs in observers)
    handles = [layers[0].register_forward_pre_hook(capture_input, with_kwargs=True)]
    for index, layer in enumerate(layers[: last_layer + 1]):
        handles.append(adapter.mlp_contribution_module(layer).register_forward_hook(capture("mlp")))
        if needs_attention:
            handles.append(adapter.input_norm(layer).register_forward_hook(capture("attn_in")))
            handles.append(adapter.attention_contribution_module(layer).register_forward_hook(capture("attn")))
        if not adapter.folds_exactly:
            handles.append(adapter.down_proj(layer).register_forward_hook(capture("down")))
        handles.append(layer.register_forward_hook(finish_layer(index)))
    try:
        for batch in tqdm(list(batches), desc=description, unit="batch"):
            mask = batch.attention_mask.to(device).bool()
            state.clear()
            state["mask"] = mask
            state["last_token"] = mask.sum(-1).cumsum(0) - 1
            try:
                adapter.decoder(model)(
                    input_ids=batch.input_ids.to(device),
                    attention_mask=batch.attention_mask.to(device),
                    position_ids=batch.position_ids.to(device),
                    use_cache=False,
                )
            except _StopForward:
                pass
            for obs in observers:
                obs.end_batch()
    finally:
        for handle in handles:
            handle.remove()
