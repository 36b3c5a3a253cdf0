"""Adding into dictionaries of float64 sums: how every accumulator folds a batch in and merges shards."""

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
