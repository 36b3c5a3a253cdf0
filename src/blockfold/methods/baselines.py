"""Baselines users compare against, built from the same pieces: nothing is put in place of what is removed.

* ``uidl``: the contiguous span with the smallest angular distance, removed as it is
  (UIDL / ShortGPT-style depth pruning without healing).
* ``drop-block``: DROP's block dropping: the blocks whose output is most similar to their input
  (mean cosine over all real tokens), wherever they are.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from blockfold.methods.base import Job
from blockfold.methods.replaceme import compress_replaceme
from blockfold.settings import ReplaceMe
from blockfold.stats import SpanStatistics
from blockfold.surgery import remove_blocks

if TYPE_CHECKING:
    from blockfold.plan import MethodPlan, PlanContext


def compress_uidl(job: Job) -> dict:
    """ReplaceMe's selection with the identity as the map: the span is removed, nothing is folded."""
    settings = ReplaceMe(**job.settings.model_dump(), estimator="identity")
    return compress_replaceme(dataclasses.replace(job, settings=settings))


def compress_drop_blocks(job: Job) -> dict:
    count = job.settings.num_blocks(job.num_layers)
    statistics = SpanStatistics(job.num_layers, max_length=1)
    # job.streams: where the refit stage follows, it records the original streams in this pass
    job.run([statistics], recorders=[job.streams] if job.streams is not None else [])
    cosine = statistics.finalize().cosine_all[: job.num_layers, 1]  # block i: cos(h[i], h[i+1])
    distances = {block: float(1.0 - cosine[block]) for block in range(job.num_layers)}
    blocks = sorted(sorted(distances, key=distances.get)[:count])
    remove_blocks(job.model, job.adapter, blocks)
    return {
        "removed_blocks": blocks,
        "selection": {"criterion": "cosine_distance_per_block", "candidates": distances,
                      "score": sum(distances[b] for b in blocks) / count},
    }


def plan_drop_blocks(context: PlanContext) -> MethodPlan:
    """DROP's plan for ``--dry-run``: one pass of the distance across each block."""
    from blockfold.plan import MethodPlan

    return MethodPlan(observers=[SpanStatistics(context.num_layers, 1)], notes=["distances only"])
