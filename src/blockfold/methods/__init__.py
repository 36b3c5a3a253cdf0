"""Named methods, each a short composition of statistics, selection, estimation and surgery."""

from __future__ import annotations

from typing import Callable

from blockfold.methods.baselines import compress_drop_blocks, compress_uidl
from blockfold.methods.nbl import compress_drop_attention, compress_nbl, compress_nbl_block
from blockfold.methods.replaceme import compress_replaceme
from blockfold.methods.sleb import compress_sleb

#: method name → function(model, tokenizer, recipe, calibration) -> manifest entries
METHODS: dict[str, Callable] = {
    "replaceme": compress_replaceme,
    "nbl": compress_nbl,
    "nbl-block": compress_nbl_block,
    "uidl": compress_uidl,
    "drop-attn": compress_drop_attention,
    "drop-block": compress_drop_blocks,
    "sleb": compress_sleb,
}

#: methods whose budget is a number of attention sublayers (``--attn``) rather than blocks
ATTENTION_METHODS = frozenset({"nbl", "drop-attn"})

#: methods that remove contiguous spans and accept ``--spans k``
SPAN_METHODS = frozenset({"replaceme", "uidl"})

__all__ = ["ATTENTION_METHODS", "METHODS", "SPAN_METHODS"]
