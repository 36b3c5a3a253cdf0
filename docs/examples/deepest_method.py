"""A whole compression method in one registration (docs/methods.md): remove the deepest blocks but the
last, the plainest depth baseline. Every flag, the recipe, ``blockfold methods``, ``--dry-run``, sweep
and the refit stage come from the registry."""

from __future__ import annotations

from typing import ClassVar

from blockfold.settings import BlockBudget, RefitStage, register_method


@register_method
class Deepest(RefitStage, BlockBudget):
    """Remove the deepest blocks but the last one, with no selection (a depth baseline)."""

    method: ClassVar[str] = "deepest"
    runner: ClassVar[str] = "deepest_method:compress_deepest"


def compress_deepest(job) -> dict:
    """The method itself: the job holds the model, the settings and the calibration set."""
    from blockfold.surgery import remove_blocks

    count = job.settings.num_blocks(job.num_layers)
    blocks = list(range(job.num_layers - 1 - count, job.num_layers - 1))
    remove_blocks(job.model, job.adapter, blocks)
    return {"removed_blocks": blocks, "selection": {"criterion": "depth", "score": 0.0}}
