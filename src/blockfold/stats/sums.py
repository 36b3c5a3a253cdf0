"""Adding into dictionaries of float64 sums: how every accumulator folds a batch in and merges shards, and
how many layers' sums one pass may hold."""

from __future__ import annotations

from collections.abc import Hashable

import torch


def add_sum(store: dict, key: Hashable, value: torch.Tensor) -> None:
    """``store[key] += value``, starting from a copy of the first value."""
    if key in store:
        store[key] += value
    else:
        store[key] = value.clone()


def add_sums(store: dict, values: dict) -> None:
    for key, value in values.items():
        add_sum(store, key, value)


def layer_groups(layers: list[int], per_layer_bytes: int, budget: int) -> list[list[int]]:
    """``layers`` split into groups whose sums fit ``budget`` bytes together (one pass each), in order;
    at least one layer per group, however small the budget."""
    size = max(1, budget // max(per_layer_bytes, 1))
    return [layers[first:first + size] for first in range(0, len(layers), size)]
