"""Named methods, each a short composition of statistics, selection, estimation and surgery.

A method is a function of a ``Job`` (model, its own typed settings from ``settings.py``, calibration
data, a runner for passes) returning its manifest entries. The settings classes are registered in
``settings.py``, which the recipe validates against without importing this package.
"""

from __future__ import annotations

from typing import Callable

from blockfold.methods.base import Job, PassCache
from blockfold.methods.baselines import compress_drop_blocks, compress_uidl
from blockfold.methods.prune_comp import compress_prune_comp
from blockfold.methods.laco import compress_laco
from blockfold.methods.linear_patch import compress_linear_patch
from blockfold.methods.nbl import compress_drop_attention, compress_nbl, compress_nbl_block
from blockfold.methods.replaceme import compress_replaceme
from blockfold.methods.sleb import compress_sleb
from blockfold.methods.streamline import compress_streamline

#: method name → function(job) -> manifest entries
METHODS: dict[str, Callable[[Job], dict]] = {
    "replaceme": compress_replaceme,
    "nbl": compress_nbl,
    "nbl-block": compress_nbl_block,
    "uidl": compress_uidl,
    "drop-attn": compress_drop_attention,
    "drop-block": compress_drop_blocks,
    "sleb": compress_sleb,
    "prune-comp": compress_prune_comp,
    "laco": compress_laco,
    "linear-patch": compress_linear_patch,
    "streamline": compress_streamline,
}

__all__ = ["METHODS", "Job", "PassCache"]
