"""Checkpoint tensors that are not the model's parameters one for one.

transformers 5 converts some checkpoints as it loads them and back as ``save_pretrained`` writes
them: a mixture of experts is stored one tensor per expert and projection
(``experts.3.w2.weight``, or ``experts.3.down_proj.weight``) and held as one stacked parameter
(``experts.down_proj``). blockfold reads and writes tensor by tensor, so it applies the same
conversions one parameter at a time, with transformers' own conversion mapping for the model:
``stored_tensors`` is what ``save_pretrained`` writes for one parameter, and ``load_stored``
rebuilds the parameter from those tensors. A model without conversions passes through unchanged.
"""

from __future__ import annotations

import weakref
from copy import deepcopy

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (PrefixChange, WeightConverter, WeightRenaming, dot_natural_key,
                                             rename_source_key, revert_weight_conversion)


def stored_tensors(model: nn.Module, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` writes for the parameter ``name`` holding ``value`` (a meta
    tensor gives their names and shapes only)."""
    if not any(_conversions(model)):
        return {name: value}
    return dict(revert_weight_conversion(model, {name: value}))


def load_stored(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters rebuilt, as ``from_pretrained`` rebuilds them, from the stored ``tensors`` of them."""
    renamings, converters = _conversions(model)
    if not converters and not renamings:
        return dict(tensors)
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    pending: dict[str, WeightConverter] = {}
    result: dict[str, torch.Tensor] = {}
    for key, tensor in sorted(tensors.items(), key=lambda item: dot_natural_key(item[0])):  # experts in order
        target, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            result[target] = tensor
            continue
        converter = pending.setdefault(target, deepcopy(by_pattern[pattern]))
        converter.add_tensor(target, key, pattern, tensor)
    for target, converter in pending.items():
        for name, value in converter.convert(target, model=model, config=model.config).items():
            result[name] = value[0] if isinstance(value, list) else value
    return result


_CONVERSIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _conversions(model: nn.Module) -> tuple[list[WeightRenaming], list[WeightConverter]]:
    """The renamings and converters between this model's parameters and its saved tensors, as
    transformers maps them for the model's current class (none for a class of shipped modeling code,
    which loads its tensors as they are named): the ones it was loaded with, else the class's mapping
    without prefix changes, as ``save_pretrained`` writes a model built in memory."""
    cached = _CONVERSIONS.get(model)
    if cached is None or cached[0] is not type(model):
        transforms = [t for t in get_model_conversion_mapping(model, add_legacy=False) or []
                      if not isinstance(t, PrefixChange)]
        if transforms and getattr(model, "_weight_conversions", None) is not None:
            transforms = model._weight_conversions
        cached = (type(model), ([t for t in transforms if isinstance(t, WeightRenaming)],
                                [t for t in transforms if isinstance(t, WeightConverter)]))
        _CONVERSIONS[model] = cached
    return cached[1]
