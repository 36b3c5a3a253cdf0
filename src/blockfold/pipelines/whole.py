"""The whole-model pipeline: the model resident on its device, one batch after the other through the
decoder (no LM head), hooks handing each layer's activations to the observers as it finishes; the
pass stops after the deepest layer any observer needs. The fast path when the model fits.

The runner hands it groups of sequences (a batch, or part of one): on a CPU it splits batches so the
observers' windows and float64 working copies, which grow with the tokens of one forward and there
set the pass's memory, stay bounded (the forward's cost per token barely changes with its size)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockfold.data import Batch
from blockfold.models.handle import ModelHandle
from blockfold.pipelines.capture import (
    SublayerCapture,
    check_finite,
    first,
    flatten,
    last_token_rows,
    needs_attention,
    needs_projection_inputs,
    take_inputs,
)
from blockfold.progress import bar
from blockfold.runtime import release_free_memory
from blockfold.stats.activations import LayerActivations, Observer


class _StopForward(Exception):
    """Raised from a hook once every observer has what it needs from this batch."""


@torch.no_grad()
def run_whole(handle: ModelHandle, groups: list[Batch], observers: list[Observer], description: str = "calibration pass",
              first_group: int = 0, after_group: Callable[[int], None] | None = None, show: bool = True) -> None:
    """Groups ``first_group``.. of ``groups`` through the model; ``after_group(n)`` once ``n`` groups are done."""
    model, adapter, device = handle.model, handle.adapter, handle.device
    layers = adapter.layers(model)
    last_layer = max(obs.last_layer for obs in observers)
    attention, inputs = needs_attention(observers), needs_projection_inputs(observers)
    state: dict = {}

    def capture_input(module, args, kwargs):
        state["block_in"] = flatten(args[0] if args else kwargs["hidden_states"], state["mask"])

    def finish_layer(index):
        def hook(module, args, output):
            block_out = flatten(first(output), state["mask"])
            check_finite(index, block_out)
            acts = LayerActivations(
                index=index, block_in=state.pop("block_in"), block_out=block_out,
                mlp_contribution=state.pop("mlp"), down_out=state.pop("down", None),
                last_token=state["last_token"], attn_input=state.pop("attn_in", None),
                attn_contribution=state.pop("attn", None), projection_inputs=take_inputs(state),
            )
            for obs in observers:
                if index <= obs.last_layer:
                    obs.on_layer(acts)
            state["block_in"] = block_out
            if index == last_layer:
                raise _StopForward
        return hook

    handles = [layers[0].register_forward_pre_hook(capture_input, with_kwargs=True)]
    captures = [SublayerCapture(layer, adapter, attention, state, inputs) for layer in layers[: last_layer + 1]]
    handles += [layer.register_forward_hook(finish_layer(index)) for index, layer in enumerate(layers[: last_layer + 1])]
    try:
        with bar(total=len(groups), initial=first_group, desc=description, unit="batch", show=show) as progress:
            for number, batch in enumerate(groups[first_group:], start=first_group):
                mask = batch.attention_mask.to(device).bool()
                state.clear()
                state["mask"] = mask
                state["last_token"] = last_token_rows(mask)
                try:
                    adapter.run_to_blocks(model, batch, device)
                except _StopForward:
                    pass
                for obs in observers:
                    obs.end_batch()
                release_free_memory()  # the group's activations and the observers' working copies
                progress.update(1)
                if after_group is not None:
                    after_group(number + 1)
    finally:
        for handle_ in handles:
            handle_.remove()
        for capture in captures:
            capture.remove()
