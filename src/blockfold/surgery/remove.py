"""Removing decoder blocks while keeping the config and the KV-cache indices consistent."""

from __future__ import annotations

from torch import nn

from blockfold.adapters import DecoderAdapter
from blockfold.errors import BlockfoldError
from blockfold.surgery.linearize import LINEARIZED_FIELD, LOW_RANK_FIELD, PRUNED_FIELD, renumber_linearized


def _per_layer_fields(config, adapter: DecoderAdapter, num_layers: int) -> list[str]:
    """Declared per-layer fields plus any other config list with one entry per layer."""
    fields = [f for f in adapter.per_layer_config_fields if getattr(config, f, None) is not None]
    for name, value in vars(config).items():
        if (isinstance(value, (list, tuple)) and len(value) == num_layers and name not in fields
                and name not in (LINEARIZED_FIELD, LOW_RANK_FIELD, PRUNED_FIELD) and name not in adapter.layer_index_config_fields):
            fields.append(name)
    return fields


def remove_blocks(model: nn.Module, adapter: DecoderAdapter, blocks: list[int]) -> None:
    """Delete ``blocks`` (0-based), then renumber the kept layers' cache indices and fix the config."""
    layers = adapter.layers(model)
    num_layers = len(layers)
    if any(b < 0 or b >= num_layers for b in blocks) or len(set(blocks)) >= num_layers:
        raise BlockfoldError(f"cannot remove blocks {blocks} from a model with {num_layers} blocks")
    keep = [i for i in range(num_layers) if i not in set(blocks)]
    sparse = [adapter.is_sparse(layer) for layer in layers]
    config = model.config
    for name in _per_layer_fields(config, adapter, num_layers):
        values = getattr(config, name)
        setattr(config, name, type(values)(values[i] for i in keep))
    for name in adapter.layer_count_config_fields:
        bound = getattr(config, name, None)
        if isinstance(bound, int):
            setattr(config, name, sum(1 for i in keep if i < bound))
    adapter.renumber_config(config, keep, sparse)
    renumber_linearized(config, keep)
    setattr(adapter.decoder(model), adapter.layers_attr, nn.ModuleList(layers[i] for i in keep))
    for new_index, layer in enumerate(adapter.layers(model)):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_index
    config.num_hidden_layers = len(keep)
