"""LLM-Streamline (Chen et al., ICLR 2025), its transformer-block form: the span of ``n + 1`` blocks
whose input and output are most alike becomes one block of the model's own architecture, trained so
that its output matches the span's output on the calibration tokens (mean squared error), starting
from the span's first block. ``n`` blocks go; the output is a standard checkpoint.

This is the one method of issue #16 that trains (a few hundred Adam steps on one block, from stored
activations, not through the model): ``train_steps=0`` keeps the span's first block as it is. The
paper's other form, a feed-forward network in place of the span, is not a block of any stock
architecture and is not offered (docs/new-methods.md).

The calibration sequences run layer by layer (``LayerProgram``) up to the end of the span, keeping
each batch's hidden state before the span and after it; the block then trains on those pairs, run in
the span's place with the masks and rotary tables the decoder gave it, as a float32 copy.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import TYPE_CHECKING

import torch

from blockfold.methods.base import Job
from blockfold.pipelines import LayerProgram
from blockfold.pipelines.buffers import ActivationStore
from blockfold.progress import bar
from blockfold.select import best_span, by_start, span_criteria
from blockfold.settings import Streamline
from blockfold.stats import SpanStatistics
from blockfold.surgery import remove_blocks

if TYPE_CHECKING:
    from blockfold.plan import MethodPlan, PlanContext

logger = logging.getLogger(__name__)


def compress_streamline(job: Job) -> dict:
    settings: Streamline = job.settings
    removed = settings.num_blocks(job.num_layers)
    length = removed + 1
    distances = SpanStatistics(job.num_layers, max_length=length)
    job.run([distances], description="span distances")
    scores = span_criteria(distances.finalize(), [], None, None)
    choice = best_span(scores[settings.criterion], length, settings.criterion)
    start, end = choice.start, choice.start + length
    losses = _train_in_place(job, start, end, settings) if settings.train_steps else []
    remove_blocks(job.model, job.adapter, list(range(start + 1, end)))
    return {
        "removed_blocks": list(range(start + 1, end)),
        "replacement": {"block": start, "replaces": list(range(start, end)), "train_steps": settings.train_steps,
                        "learning_rate": settings.learning_rate,
                        "mse_first": losses[0] if losses else None, "mse_last": losses[-1] if losses else None,
                        "mse_per_step": losses},
        "selection": {"criterion": settings.criterion, "start": start, "length": length, "score": choice.score,
                      "candidates": by_start(scores[settings.criterion], length)},
    }


def _train_in_place(job: Job, start: int, end: int, settings: Streamline) -> list[float]:
    """Train block ``start`` (a float32 copy) to map the stream before the span to the stream after it;
    the trained weights become the block's own (saved in the model's dtype). Returns the loss per step."""
    handle = job.handle
    batches = list(job.calibration)
    losses = []
    with ActivationStore(job.runner.store_kind(batches, 3), handle.device, job.runner.execution.offload_dir) as store:
        program = LayerProgram(handle, batches, store, end - 1)
        for index in range(end):
            if index == start:
                for number in range(len(batches)):
                    store.put(f"before{number}", program.hidden(number))
            with program.layer(index) as (_, run):
                for number in range(len(batches)):
                    program.set_hidden(number, run(program.hidden(number), number))
        job.runner.sweep()
        block = handle.layers()[start]
        with handle.materialized(block):
            trained = copy.deepcopy(block).float()
        for param in trained.parameters():
            param.requires_grad_(True)
        optimizer = torch.optim.Adam(trained.parameters(), lr=settings.learning_rate)
        masks = [batch.attention_mask.bool().to(handle.device) for batch in batches]
        for step in bar(range(settings.train_steps), desc=f"training block {start} in place of {start}-{end - 1}",
                         unit="step", leave=False):
            number = step % len(batches)
            with torch.enable_grad():
                output = program.run_in_place_of(start, trained, store.get(f"before{number}").float(), number,
                                                 dtype=torch.float32)
                target = program.hidden(number).float()
                loss = (output[masks[number]] - target[masks[number]]).pow(2).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            losses.append(loss.detach().item())
    trained_values = dict(trained.named_parameters())
    for name, _ in block.named_parameters():
        owner_name, _, attr = name.rpartition(".")
        handle.own(block.get_submodule(owner_name) if owner_name else block, attr, trained_values[name].detach())
    logger.info("block %d trained in place of blocks %d-%d: MSE %.4g -> %.4g", start, start, end - 1, losses[0], losses[-1])
    return losses


def plan_streamline(context: PlanContext) -> MethodPlan:
    """LLM-Streamline's plan for ``--dry-run``: span distances, then the streams around the chosen span
    (kept for the training, which reads them back)."""
    from blockfold.plan import MethodPlan, gib

    settings, num_layers = context.settings, context.num_layers
    n = settings.num_blocks(num_layers)
    kept = 2 * context.tokens * context.hidden_size * context.element
    batches = math.ceil(context.calibration.num_sequences / context.calibration.batch_size)
    # each training step runs the new block on one calibration batch (_train_in_place): steps / batches passes
    # of the calibration set through one of the model's blocks
    return MethodPlan(passes=2, observers=[SpanStatistics(num_layers, n + 1)],
                      extra_forward=settings.train_steps / batches / num_layers,
                      notes=[f"span distances; the stream before and after the span kept for all calibration tokens "
                             f"({gib(kept)}), then {settings.train_steps} training steps on one block"])
