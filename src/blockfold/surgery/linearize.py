"""Replacing attention sublayers or whole blocks by linear maps (NBL) or by nothing (DROP-attn), and
projections by two low-rank factors (SVD-LLM).

The replacement modules and the checkpoint classes live in ``modeling_blockfold.py``, which is
shipped inside every such checkpoint; this module applies them to a model in memory and turns the
model into its blockfold class, so ``save_pretrained`` writes the remote-code config and file.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from blockfold.errors import BlockfoldError
from blockfold.models.handle import ModelHandle
from blockfold.surgery import modeling_blockfold as shipped

LINEARIZED_FIELD = shipped.LINEARIZED_FIELD
LOW_RANK_FIELD = shipped.LOW_RANK_FIELD
SLICED_FIELD = shipped.SLICED_FIELD
PRUNED_FIELD = shipped.PRUNED_FIELD


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
    config_class, model_class = _blockfold_classes(model)
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
    setattr(model.config, LINEARIZED_FIELD, sorted(kept + entries, key=lambda entry: entry["layer"]))
    _become(model, config_class, model_class)


def _blockfold_classes(model: PreTrainedModel) -> tuple[type, type]:
    """The config and causal-LM classes of ``model``'s family that ship with their modeling code."""
    base_type = model.config.model_type.removeprefix("blockfold_")
    if base_type not in shipped.LINEARIZED_CLASSES:
        raise BlockfoldError(f"no blockfold form of {base_type!r} models (linear or low-rank replacements): "
                             "add one to surgery/modeling_blockfold.py")
    return shipped.LINEARIZED_CLASSES[base_type]


def _become(model: PreTrainedModel, config_class: type, model_class: type) -> None:
    model.config.__class__ = config_class
    model.config.architectures = [model_class.__name__]
    model.__class__ = model_class


@torch.no_grad()
def factor_projections(handle: ModelHandle, factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Store each projection ``(layer, dotted name)`` as ``second @ first`` (``first``: rank × in,
    ``second``: out × rank), keeping its bias; the factors are owned by the handle. The entries go to
    the config (``blockfold_low_rank``), where the shipped modeling code reads them back."""
    model, adapter = handle.model, handle.adapter
    config_class, model_class = _blockfold_classes(model)
    layers = adapter.layers(model)
    device = None if handle.resident else "meta"  # asked once: the first meta module would change the answer
    entries = []
    for (index, name), (first, second) in sorted(factors.items()):
        layer = layers[index]
        linear = adapter.linear_projections(layer)[name]
        bias = handle.saved_value(linear, "bias") if linear.bias is not None else None
        entry = {"layer": index, "module": name, "rank": int(first.shape[0])}
        factored = shipped.factor_projection(layer, entry, device=device)
        handle.own(factored.first, "weight", first)
        handle.own(factored.second, "weight", second)
        if bias is not None:
            handle.own(factored.second, "bias", bias)
        entries.append(entry)
    earlier = [entry for entry in getattr(model.config, LOW_RANK_FIELD, None) or ()
               if (entry["layer"], entry["module"]) not in factors]
    setattr(model.config, LOW_RANK_FIELD, sorted(earlier + entries, key=lambda entry: (entry["layer"], entry["module"])))
    _become(model, config_class, model_class)


@torch.no_grad()
def prune_projections(handle: ModelHandle, kept: dict[tuple[int, str], tuple[torch.Tensor | None, torch.Tensor | None]]) -> None:
    """Keep only some rows (outputs) and columns (inputs) of each projection ``(layer, dotted name)``:
    ``kept`` gives the indices of each (None: all). The weights are owned by the handle; the config
    records the new shapes (``blockfold_pruned``), which the shipped modeling code rebuilds."""
    model, adapter = handle.model, handle.adapter
    config_class, model_class = _blockfold_classes(model)
    layers = adapter.layers(model)
    device = None if handle.resident else "meta"  # asked once: the first meta module would change the answer
    entries = []
    for (index, name), (rows, columns) in sorted(kept.items(), key=lambda item: item[0]):
        linear = adapter.linear_projections(layers[index])[name]
        weight = handle.saved_value(linear, "weight").double().cpu()
        bias = handle.saved_value(linear, "bias").double().cpu() if linear.bias is not None else None
        if rows is not None:
            weight, bias = weight[rows], bias[rows] if bias is not None else None
        if columns is not None:
            weight = weight[:, columns]
        entry = {"layer": index, "module": name, "shape": list(weight.shape)}
        resized = shipped.resize_projection(layers[index], entry, device=device)
        handle.own(resized, "weight", weight)
        if bias is not None:
            handle.own(resized, "bias", bias)
        entries.append(entry)
    setattr(model.config, PRUNED_FIELD, entries)
    _become(model, config_class, model_class)


@torch.no_grad()
def attach_sliced(handle: ModelHandle, width: int, head_map: torch.Tensor | None,
                  rms_norms: dict[str, float] | None = None, norm_eps: float | None = None,
                  head_bias: torch.Tensor | None = None) -> None:
    """Give ``handle``'s model, whose weights were rotated and sliced to ``width``, the config that says so:
    its hidden size becomes ``width`` (the heads keep theirs). Without more that is a stock model of a
    narrower stream (a standard checkpoint every engine loads). A ``head_map`` (``width × width``, the stream
    times it after the final norm, for tied embeddings), LayerNorms of the stream that lost their mean
    subtraction (``rms_norms``: dotted name → the gain they become, with epsilon ``norm_eps``) or a bias the LM head did not have
    (``head_bias``) make it its blockfold class, which owns them, and the config records them
    (``blockfold_sliced``)."""
    model = handle.model
    config = model.config
    if getattr(config, "head_dim", None) is None:
        config.head_dim = config.hidden_size // config.num_attention_heads
    config.hidden_size = width
    if head_map is None and not rms_norms and head_bias is None:
        return
    config_class, model_class = _blockfold_classes(model)
    setattr(config, SLICED_FIELD, {"head_map": head_map is not None, "rms_norms": list(rms_norms or {}),
                                   "norm_eps": norm_eps, "head_bias": head_bias is not None})
    device = None if handle.resident else "meta"  # asked before the new modules change the answer
    added = shipped.attach_slicing(model, config, device=device)
    for module in added["head_map"]:
        handle.own(module, "weight", head_map.T)  # nn.Linear computes x Wᵀ
    for module, gain in zip(added["norms"], (rms_norms or {}).values()):
        handle.own(module, "weight", torch.full((width,), gain))
    for head in added["head_bias"]:
        handle.own(head, "bias", head_bias)
    _become(model, config_class, model_class)


def renumber_linearized(config, keep: list[int]) -> None:
    """After blocks were removed (``keep`` = old indices of the kept ones), renumber the entries of
    both fields (linear replacements and low-rank projections)."""
    new_index = {old: new for new, old in enumerate(keep)}
    for field in (LINEARIZED_FIELD, LOW_RANK_FIELD, PRUNED_FIELD):
        entries = getattr(config, field, None)
        if entries:
            setattr(config, field, [{**entry, "layer": new_index[entry["layer"]]}
                                    for entry in entries if entry["layer"] in new_index])
