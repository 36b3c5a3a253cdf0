"""Prune&Comp (Chen et al., AAAI 2026): iterative block removal with magnitude compensation.

Removing block ``b`` leaves the residual stream that reaches the later blocks smaller than it was
(the block's contribution is missing), so what those blocks add weighs more than it did. Each round
measures, on the model as pruned so far, every block's importance and the stream's mean absolute
value per channel at every boundary; it removes the least important block and compensates with one
scalar ``s = mean_c E|h_{b+1,c}| / E|h_{b,c}|``.

The paper multiplies the embedding and every writer to the residual stream *before* the gap by
``s``. Under pre-norm (and sandwich) blocks every block and the final norm read the stream through
a scale-invariant norm, so scaling every writer *after* the gap by ``1/s`` gives the same function
up to the norms' epsilon, and it also holds for tied input and output embeddings, which the paper's
form would rescale. Nothing is added: the output is a standard checkpoint with fewer blocks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from blockfold.methods.base import Job
from blockfold.methods.sleb import candidate_losses
from blockfold.progress import bar
from blockfold.settings import PruneComp
from blockfold.stats import SpanStatistics
from blockfold.stats.magnitude import StreamMagnitude
from blockfold.surgery import remove_blocks, scale_block_output

if TYPE_CHECKING:
    from blockfold.plan import MethodPlan, PlanContext

logger = logging.getLogger(__name__)


def magnitude_gap(magnitudes: dict[int, torch.Tensor], block: int) -> float:
    """Prune&Comp's scalar for removing ``block``: the mean over channels of how much larger the
    stream's mean absolute value is after the block than before it."""
    before, after = magnitudes[block], magnitudes[block + 1]
    return float((after / before.clamp_min(torch.finfo(torch.float64).tiny)).mean())


def _importance(job: Job, settings: PruneComp) -> tuple[dict[int, float], dict[int, torch.Tensor]]:
    """Every block's importance (lower: removed first) and the stream magnitudes, on the model as it is."""
    magnitude = StreamMagnitude(job.num_layers)
    if settings.importance == "block_influence":
        distances = SpanStatistics(job.num_layers, max_length=1)
        job.run([distances, magnitude], description="importance pass")
        cosine = distances.finalize().cosine_all[: job.num_layers, 1]  # block b: cos(h[b], h[b+1])
        return {block: float(1.0 - cosine[block]) for block in range(job.num_layers)}, magnitude.finalize()
    losses = candidate_losses(job.handle, list(job.calibration), list(range(job.num_layers)),
                              job.runner.store_kind(job.calibration), job.runner.execution.offload_dir)
    job.runner.sweep()
    job.run([magnitude], description="magnitude pass")
    return losses, magnitude.finalize()


def compress_prune_comp(job: Job) -> dict:
    settings: PruneComp = job.settings
    count = settings.num_blocks(job.num_layers)
    original_index = list(range(job.num_layers))
    steps = []
    for _ in bar(range(count), desc="Prune&Comp", unit="block"):
        importance, magnitudes = _importance(job, settings)
        block = min(importance, key=importance.get)
        scale = magnitude_gap(magnitudes, block)
        if settings.compensate:
            for later in job.handle.layers()[block + 1:]:
                scale_block_output(job.handle, later, 1.0 / scale)
        logger.info("removing block %d (%s %.4g), magnitude gap %.4f", original_index[block], settings.importance,
                    importance[block], scale)
        steps.append({"removed": original_index[block], "importance": importance[block], "magnitude_gap": scale,
                      "candidates": {original_index[b]: v for b, v in importance.items()}})
        remove_blocks(job.model, job.adapter, [block])
        del original_index[block]
    removed = [step["removed"] for step in steps]
    return {
        "removed_blocks": sorted(removed),
        "compensation": ({"form": "writers after each gap scaled by 1/s (the paper's s on the stream before it)",
                          "scales": [step["magnitude_gap"] for step in steps],
                          "by_block": {step["removed"]: step["magnitude_gap"] for step in steps}}
                         if settings.compensate else None),
        "selection": {"criterion": f"{settings.importance}_iterative", "order": removed,
                      "score": steps[-1]["importance"], "candidates": steps[0]["candidates"], "steps": steps},
    }


def plan_prune_comp(context: PlanContext) -> MethodPlan:
    """Prune&Comp's plan for ``--dry-run``: one importance pass per removed block (two with perplexity)."""
    from blockfold.plan import MethodPlan, gib

    settings, num_layers = context.settings, context.num_layers
    n = settings.num_blocks(num_layers)
    perplexity = settings.importance == "perplexity"
    note = "distances and per-channel magnitudes, one pass per removed block" + (
        f" after one stream per candidate block ({gib(num_layers * context.tokens * context.hidden_size * context.element)})"
        if perplexity else "")
    # step s runs its pass over the L - s blocks left (and, by perplexity, SLEB's streams over them first)
    runs = sum((num_layers - step) * (1 + ((num_layers - step + 1) / 2 if perplexity else 0)) for step in range(n))
    passes = 2 * n if perplexity else n
    return MethodPlan(passes=passes, notes=[note], extra_forward=runs / num_layers - passes,
                      observers=[SpanStatistics(num_layers, 1), StreamMagnitude(num_layers)])
