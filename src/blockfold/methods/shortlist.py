"""ReplaceMe's ``shortlist``: the criterion's best spans at different depths, kept by what the model with
each span replaced does on calibration sequences its maps were not fitted on.

A fit criterion scores a span by how well one linear map replaces it locally; the span that fits best
locally is not always the one whose removal the model survives best (an early span can fit well and
still derail every later block). So the criterion proposes a few spans that do not overlap, and the
model's own next-token loss decides between them, at a fraction of a pass:

- each candidate's map is the one its score used, fitted on the first pass's sums less those of the
  held-out sequences (a pass over those alone, up to the deepest candidate's end): held-out in fact;
- one sweep of the layers over the held-out sequences carries the model's own stream and, from each
  candidate's last block on, the stream with the span replaced by its map (the output of the block
  before the span with the map applied to its MLP contribution, exactly what folding it gives), so
  every layer is loaded once and each candidate runs only the blocks after it.
"""

from __future__ import annotations

import math

import torch

from blockfold.data import Batch
from blockfold.eval.perplexity import stream_nll
from blockfold.methods.base import Job
from blockfold.pipelines import LayerProgram
from blockfold.pipelines.buffers import ActivationStore
from blockfold.pipelines.capture import first
from blockfold.progress import bar
from blockfold.select import SpanChoice, span_label
from blockfold.stats import NormalEquations, SpanStatistics


def held_out_sums(job: Job, batches: list[Batch], candidates: list[SpanChoice]) -> dict[int, NormalEquations]:
    """Start → the fit's sums over ``batches`` alone (one pass over them, as far as the deepest candidate)."""
    length = candidates[0].length
    statistics = SpanStatistics(job.num_layers, 0, fit_length=length, starts=[c.start for c in candidates],
                                stream_weighted=False)
    job.runner.run(batches, [statistics], "held-out sums")
    return statistics.finalize().normal_equations


@torch.no_grad()
def shortlist_losses(job: Job, candidates: list[SpanChoice], batches: list[Batch],
                     maps: dict[int, torch.Tensor | None]) -> dict:
    """The mean next-token loss on ``batches`` of the model as it is and with each candidate span
    replaced by its map (start → map; None: the span removed, nothing folded), in one sweep."""
    handle, adapter = job.handle, job.adapter
    num_layers = handle.num_layers()
    ends: dict[int, list[SpanChoice]] = {}
    for c in candidates:
        ends.setdefault(c.start + c.length - 1, []).append(c)
    before = {c.start - 1: c for c in candidates}
    pending: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # start → (rest of the block, contribution)
    with ActivationStore(job.runner.store_kind(batches, 1 + len(candidates)), handle.device,
                         job.runner.execution.offload_dir) as store:
        program = LayerProgram(handle, batches, store, num_layers - 1)
        streams: dict[int | None, list[torch.Tensor]] = {None: [program.hidden(n) for n in range(len(batches))]}
        for index in bar(range(num_layers), desc="shortlist", unit="layer", leave=False):
            with program.layer(index) as (block, run):
                captured: list[torch.Tensor] = []
                hook = (adapter.mlp_contribution_module(block).register_forward_hook(
                    lambda module, args, output: captured.append(first(output))) if index in before else None)
                try:
                    outputs = [run(hidden, n) for n, hidden in enumerate(streams[None])]
                finally:
                    if hook is not None:
                        hook.remove()
                if index in before:
                    pending[before[index].start] = [(out - x, x) for out, x in zip(outputs, captured)]
                for start, hidden in streams.items():
                    if start is not None:
                        streams[start] = [run(h, n) for n, h in enumerate(hidden)]
                streams[None] = outputs
            for c in ends.get(index, []):  # the span ends here: its stream goes on from the next block
                transform = maps[c.start]
                streams[c.start] = [rest + (x if transform is None else
                                            (x.float() @ transform.to(x.device, torch.float32)).to(x.dtype))
                                    for rest, x in pending.pop(c.start)]
        totals = stream_nll(handle, batches, streams)
    job.runner.sweep()
    losses = {start: nll / max(count, 1) for start, (nll, count) in totals.items()}
    entries = {span_label(c.blocks): {"start": c.start, "score": c.score, "mean_nll": losses[c.start]}
               for c in candidates}
    chosen = min(entries, key=lambda label: entries[label]["mean_nll"])  # the criterion's best on a tie
    return {"measure": "mean next-token loss on held-out calibration sequences, each span replaced by its "
                       "scoring map fitted without them",
            "held_out_sequences": sum(len(batch) for batch in batches),
            "held_out_tokens": sum(batch.num_tokens for batch in batches),
            "original_mean_nll": losses[None], "candidates": entries, "chosen": chosen,
            "perplexity_ratio": {label: math.exp(entry["mean_nll"] - losses[None]) for label, entry in entries.items()}}


__all__ = ["held_out_sums", "shortlist_losses"]
