"""SLEB: remove blocks one at a time, each time the block whose removal raises calibration perplexity least.

Every step scores every remaining block with the whole model's loss. The calibration sequences run
through the decoder layer by layer (``LayerProgram``, on a resident or a streamed model alike), with
one stream of hidden states per candidate: the stream that skips block ``b`` branches off the
unskipped one at ``b`` and goes on through every later block. One step is therefore one pass over
the layers, each layer loaded once, running about (blocks²/2) block-passes in all, and exact. Use a
small calibration set: the streams of all candidates are kept at once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from blockfold.data import Batch
from blockfold.eval.perplexity import stream_nll
from blockfold.methods.base import Job
from blockfold.models.handle import ModelHandle
from blockfold.pipelines import LayerProgram
from blockfold.pipelines.buffers import ActivationStore
from blockfold.progress import bar
from blockfold.surgery import remove_blocks

if TYPE_CHECKING:
    from blockfold.plan import MethodPlan, PlanContext

@torch.no_grad()
def candidate_losses(handle: ModelHandle, batches: list[Batch], candidates: list[int],
                     store_kind: str = "device", offload_dir: str | None = None) -> dict[int, float]:
    """Calibration perplexity of the model with each candidate block skipped (the others as they are)."""
    num_layers = handle.num_layers()
    with ActivationStore(store_kind, handle.device, offload_dir) as store:
        program = LayerProgram(handle, batches, store, num_layers - 1)
        streams = {None: [program.hidden(n) for n in range(len(batches))]}  # skipped block → hidden per batch
        for index in bar(range(num_layers), desc="scoring blocks", unit="layer", leave=False):
            if index in candidates:
                streams[index] = list(streams[None])  # skipping this block: the stream before it goes on
            with program.layer(index) as (_, run):
                for skipped, hidden in streams.items():
                    if skipped != index:
                        streams[skipped] = [run(h, n) for n, h in enumerate(hidden)]
            if index == max(candidates):
                streams.pop(None)  # no later block branches off the unskipped stream
        totals = stream_nll(handle, batches, streams)
    return {block: math.exp(nll / count) for block, (nll, count) in totals.items()}


def compress_sleb(job: Job) -> dict:
    count = job.settings.num_blocks(job.num_layers)
    original_index = list(range(job.num_layers))
    batches = job.calibration.first_sequences(job.settings.score_sequences)
    steps = []
    for _ in bar(range(count), desc="SLEB", unit="block"):
        perplexities = candidate_losses(job.handle, batches, list(range(job.num_layers)),
                                        job.runner.store_kind(batches), job.runner.execution.offload_dir)
        job.runner.sweep()  # one sweep of the layers, a stream per candidate
        best = min(perplexities, key=perplexities.get)
        steps.append({"removed": original_index[best], "calibration_perplexity": perplexities[best],
                      "candidates": {original_index[b]: v for b, v in perplexities.items()}})
        remove_blocks(job.model, job.adapter, [best])
        del original_index[best]
    removed = [step["removed"] for step in steps]
    return {
        "removed_blocks": sorted(removed),
        "selection": {"criterion": "calibration_perplexity_greedy", "order": removed,
                      "score": steps[-1]["calibration_perplexity"], "candidates": steps[0]["candidates"],
                      "steps": steps, "scored_sequences": sum(len(batch) for batch in batches)},
    }


def plan_sleb(context: PlanContext) -> MethodPlan:
    """SLEB's plan for ``--dry-run``: one step per removed block, each keeping a stream per candidate."""
    from blockfold.plan import MethodPlan, gib

    share = context.calibration.share_of_first(context.settings.score_sequences)
    streams = context.num_layers * share * context.tokens * context.hidden_size * context.element
    steps = context.settings.num_blocks(context.num_layers)
    # a step over L blocks runs the unskipped stream through all L and the stream skipping block b through
    # the L - 1 - b after it: L (L + 1) / 2 block runs, over the sequences it scores on
    runs = sum((context.num_layers - step) * (context.num_layers - step + 1) / 2 for step in range(steps))
    return MethodPlan(passes=steps, extra_forward=share * runs / context.num_layers - steps,
                      notes=[f"one stream per candidate block: {gib(streams)} of hidden states (use a small "
                             "calibration set, or score_sequences)"])
