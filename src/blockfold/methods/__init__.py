"""Named methods, each a short composition of statistics, selection, estimation and surgery."""

from __future__ import annotations

from typing import Callable

from blockfold.methods.baselines import compress_drop_blocks, compress_uidl
from blockfold.methods.replaceme import compress_replaceme

#: method name → function(model, tokenizer, recipe, calibration) -> manifest entries
METHODS: dict[str, Callable] = {
    "replaceme": compress_replaceme,
    "uidl": compress_uidl,
    "drop-block": compress_drop_blocks,
}

__all__ = ["METHODS"]
