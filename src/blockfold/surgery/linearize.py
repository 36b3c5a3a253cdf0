"""Replacing attention sublayers or whole blocks by linear maps (NBL) or by nothing (DROP-attn).

The replacement modules and the checkpoint classes live in ``modeling_blockfold.py``, which is
shipped inside every such checkpoint; this module applies them to a model in memory and turns the
model into its linearized class, so ``save_pretrained`` writes the remote-code config and file.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from blockfold.errors import BlockfoldError
from blockfold.models.handle import ModelHandle
from blockfold.surgery import modeling_blockfold as shipped

LINEARIZED_FIELD = shipped.LINEARIZED_FIELD


def register_linearized_classes() -> None:
    """Let ``AutoModelForCausalLM`` load blockfold checkpoints in this process without remote code."""
    for config_class, model_class in shipped.LINEARIZED_CLASSES.values():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)


def linearized_entries(model: PreTrainedModel) -> list[dict]:
    return list(getattr(model.config, LINEARIZED_FIELD, None) or [])


@torch.no_grad()
def replace_sublayers(
    handle: ModelHandle,
    entries: list[dict],
    maps: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> None:
    """Apply replacement ``entries`` (from the adapter) in place; ``maps[layer] = (W, b)`` for linear
    ones, which the handle owns (they come from no checkpoint). The model's class and config class
    become the linearized ones, and the entries are recorded in the config, where the shipped
    modeling code reads them back.
    """
    maps = maps or {}
    model, adapter = handle.model, handle.adapter
    base_type = model.config.model_type.removeprefix("blockfold_")
    if base_type not in shipped.LINEARIZED_CLASSES:
        raise BlockfoldError(f"no linearized form of {base_type!r} models: add one to surgery/modeling_blockfold.py")
    config_class, model_class = shipped.LINEARIZED_CLASSES[base_type]
    layers = adapter.layers(model)
    for entry in entries:
        layer = layers[entry["layer"]]
        shipped.linearize_layer(layer, entry, adapter.hidden_size(model))
        if entry["replacement"] == "linear":
            weight, bias = maps[entry["layer"]]
            linear = getattr(layer, entry["module"]).linear
            handle.own(linear, "weight", weight)
            handle.own(linear, "bias", bias)
    replaced = {entry["layer"] for entry in entries}
    kept = [entry for entry in linearized_entries(model) if entry["layer"] not in replaced]
    model.config.__class__ = config_class
    setattr(model.config, LINEARIZED_FIELD, sorted(kept + entries, key=lambda entry: entry["layer"]))
    model.config.architectures = [model_class.__name__]
    model.__class__ = model_class


def renumber_linearized(config, keep: list[int]) -> None:
    """After blocks were removed (``keep`` = old indices of the kept ones), renumber the entries."""
    entries = getattr(config, LINEARIZED_FIELD, None)
    if not entries:
        return
    new_index = {old: new for new, old in enumerate(keep)}
    setattr(config, LINEARIZED_FIELD, [{**entry, "layer": new_index[entry["layer"]]}
                                       for entry in entries if entry["layer"] in new_index])
