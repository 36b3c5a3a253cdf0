"""Hooks at the points an adapter names, shared by every pipeline: what a decoder layer's sublayers
add to the residual stream, for the real (non-padding) tokens, as rows."""

from __future__ import annotations

import torch
from torch import nn

from blockfold.adapters import DecoderAdapter
from blockfold.data import Batch
from blockfold.errors import BlockfoldError
from blockfold.stats.activations import Observer


def first(output):
    """A module's main output (decoder layers and attention modules may return tuples)."""
    return output[0] if isinstance(output, tuple) else output


def needs_attention(observers: list[Observer]) -> bool:
    return any(getattr(obs, "needs_attention", False) for obs in observers)


def needs_projection_inputs(observers: list[Observer]) -> bool:
    return any(getattr(obs, "needs_projection_inputs", False) for obs in observers)


class SublayerCapture:
    """Forward hooks on one layer's sublayers that store their outputs, flattened to the real tokens
    of ``mask``, into ``store`` under "mlp", "down", "attn_in" and "attn"; with ``inputs``, what every
    linear projection reads under "inputs" (name → rows; projections fed one tensor share its rows)."""

    def __init__(self, layer: nn.Module, adapter: DecoderAdapter, attention: bool, store: dict,
                 inputs: bool = False):
        self.store = store
        points = [("mlp", adapter.mlp_contribution_module(layer))]
        if attention:
            points += [("attn_in", adapter.input_norm(layer)), ("attn", adapter.attention_contribution_module(layer))]
        if not adapter.folds_exactly:
            points.append(("down", adapter.down_proj(layer)))
        self.handles = [module.register_forward_hook(self._hook(key)) for key, module in points]
        if inputs:
            self.handles += [linear.register_forward_pre_hook(self._input_hook(name))
                             for name, linear in adapter.linear_projections(layer).items()]

    def _hook(self, key: str):
        def hook(module, args, output):
            self.store[key] = flatten(first(output), self.store["mask"])
        return hook

    def _input_hook(self, name: str):
        def hook(module, args):
            seen = self.store.setdefault("_read", [])  # (input, its rows): q, k and v read one tensor
            rows = next((rows for tensor, rows in seen if tensor is args[0]), None)
            if rows is None:
                rows = flatten(args[0], self.store["mask"])
                seen.append((args[0], rows))
            self.store.setdefault("inputs", {})[name] = rows
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def take_inputs(store: dict) -> dict[str, torch.Tensor] | None:
    """The projection inputs captured for one layer (and forget the tensors they were read from)."""
    store.pop("_read", None)
    return store.pop("inputs", None)


def join_inputs(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One layer's projection inputs from several batches, joined by rows; names that shared one
    tensor in every batch share the joined one."""
    joined: dict[str, torch.Tensor] = {}
    for name in parts[0]:
        twin = next((other for other in joined if all(part[other] is part[name] for part in parts)), None)
        joined[name] = joined[twin] if twin is not None else torch.cat([part[name] for part in parts])
    return joined


def flatten(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The rows of real tokens, (tokens, d), in the model's own dtype: observers convert to float64
    where they accumulate, and keep their windows of recent layers at the activations' size."""
    return hidden[mask]


def last_token_rows(mask: torch.Tensor) -> torch.Tensor:
    """Row index, in the flattened real tokens, of each sequence's last real token."""
    return mask.sum(-1).cumsum(0) - 1


def split_rows(batches: list[Batch], most: int | None) -> list[Batch]:
    """The batches, each larger than ``most`` sequences split by rows (None: as they are)."""
    if most is None:
        return batches
    return [batch.rows(i, i + most) for batch in batches for i in range(0, len(batch), most)]


def check_finite(index: int, block_out: torch.Tensor) -> None:
    """Stop at the first layer whose output is not finite, naming it: the sums would carry the NaN
    into every fit and end in a linear-algebra error far from its cause."""
    if not bool(torch.isfinite(block_out).all()):
        raise BlockfoldError(
            f"layer {index}'s output holds NaN or infinite values (in {str(block_out.dtype).removeprefix('torch.')} on {block_out.device.type}): "
            "check that layer's weights in the checkpoint; with --dtype float16, use bfloat16 or float32 instead"
        )
