"""LaCo (Yang et al., 2024): layer collapse. Consecutive blocks ``l..l+m`` become one block whose
attention and MLP weights are ``θ_l + Σ_k (θ_{l+k} − θ_l)`` (the paper's RDSC merge: layer ``l``'s
parameters plus every later layer's difference from them), and blocks ``l+1..l+m`` go. The norms are
block ``l``'s. The result is a standard checkpoint with fewer blocks and no new parameters.

The paper scans from the top down and keeps a merge when the final representation of a few
calibration sentences stays more similar to the original's than a threshold, which must be tuned
per model to reach a given size. blockfold is given a budget instead, so each round it measures
every position's merge of ``merge_layers`` blocks (fewer in the last round, to land on the budget)
and keeps the one whose last-layer output stays most similar to the original model's (mean cosine
over the real tokens of the first ``similarity_sequences`` calibration sequences).

All candidates of a round share one layer-by-layer pass (``LayerProgram``, as SLEB's scoring): the
stream that merges at ``l`` branches off the unmerged one at ``l``, runs the merged block, skips the
merged ones and goes on through every later block.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from blockfold.data import Batch
from blockfold.errors import BlockfoldError
from blockfold.methods.base import Job
from blockfold.models.handle import ModelHandle
from blockfold.models.quantized import is_quantized_linear
from blockfold.pipelines import LayerProgram
from blockfold.pipelines.buffers import ActivationStore
from blockfold.progress import bar
from blockfold.settings import LaCo
from blockfold.surgery import remove_blocks

if TYPE_CHECKING:
    from blockfold.plan import MethodPlan, PlanContext

logger = logging.getLogger(__name__)


def _shapes(handle: ModelHandle, block: int) -> dict[str, tuple]:
    adapter, layer = handle.adapter, handle.layers()[block]
    return {f"{part.__name__}.{name}": tuple(param.shape) for part in (adapter.attention, adapter.mlp)
            for name, param in part(layer).named_parameters()}


def mergeable(handle: ModelHandle, first: int, merged: int) -> bool:
    """Blocks ``first..first+merged`` have attention and MLP parameters of the same names and shapes
    (not so where a dense block meets a mixture of experts)."""
    shapes = _shapes(handle, first)
    return all(_shapes(handle, first + k) == shapes for k in range(1, merged + 1))


def collapse_deltas(handle: ModelHandle, first: int, merged: int) -> dict[tuple[nn.Module, str], torch.Tensor]:
    """For every attention and MLP parameter of block ``first``: ``Σ_k (θ_{first+k} − θ_first)``,
    ``k = 1..merged``, in float64 on the CPU."""
    adapter, layers = handle.adapter, handle.layers()
    blocks = [layers[first + k] for k in range(merged + 1)]
    deltas = {}
    with handle.materialized(*blocks):
        for part in (adapter.attention, adapter.mlp):
            target = dict(part(blocks[0]).named_parameters())
            others = [dict(part(block).named_parameters()) for block in blocks[1:]]
            for name, param in target.items():
                owner_name, _, attr = name.rpartition(".")
                owner = part(blocks[0]).get_submodule(owner_name) if owner_name else part(blocks[0])
                if is_quantized_linear(owner):
                    raise BlockfoldError("laco merges float weights: a 4-bit checkpoint's blocks cannot be collapsed; "
                                         "run laco on the float model")
                if any(name not in other or other[name].shape != param.shape for other in others):
                    raise BlockfoldError(f"laco needs blocks of one shape: {name} differs between blocks "
                                         f"{first}..{first + merged}")
                base = param.detach().to("cpu", torch.float64)
                deltas[owner, attr] = sum(other[name].detach().to("cpu", torch.float64) - base for other in others)
    return deltas


def _merged_block(handle: ModelHandle, first: int, merged: int) -> nn.Module:
    """A loaded private copy of block ``first`` with blocks ``first+1..first+merged`` collapsed into it."""
    deltas = collapse_deltas(handle, first, merged)
    block = handle.layers()[first]
    with handle.materialized(block):
        copied = copy.deepcopy(block)
    originals = dict(block.named_modules())
    copies = {id(originals[name]): module for name, module in copied.named_modules()}
    with torch.no_grad():
        for (owner, attr), delta in deltas.items():
            param = copies[id(owner)]._parameters[attr]
            param.copy_((param.double() + delta.to(param.device)).to(param.dtype))
    return copied


@torch.no_grad()
def last_block_outputs(handle: ModelHandle, batches: list[Batch], store_kind: str = "device",
                       offload_dir: str | None = None) -> list[torch.Tensor]:
    """The last block's output at the real tokens of each batch (float32, on the CPU): the reference."""
    num_layers = handle.num_layers()
    with ActivationStore(store_kind, handle.device, offload_dir) as store:
        program = LayerProgram(handle, batches, store, num_layers - 1)
        hidden = [program.hidden(n) for n in range(len(batches))]
        for index in range(num_layers):
            with program.layer(index) as (_, run):
                hidden = [run(h, n) for n, h in enumerate(hidden)]
    return [h[batch.attention_mask.bool().to(h.device)].float().cpu() for h, batch in zip(hidden, batches)]


@torch.no_grad()
def candidate_similarities(handle: ModelHandle, batches: list[Batch], merged: int, reference: list[torch.Tensor],
                           store_kind: str = "device", offload_dir: str | None = None) -> dict[int, float]:
    """For every ``l``: the mean cosine, over real tokens, between the last block's output with blocks
    ``l..l+merged`` collapsed and ``reference``."""
    num_layers = handle.num_layers()
    candidates = [first for first in range(num_layers - merged) if mergeable(handle, first, merged)]
    if not candidates:
        raise BlockfoldError(f"laco: no {merged + 1} consecutive blocks have attention and MLP weights of one shape "
                             "(dense blocks and mixtures of experts alternate?): use --merge-layers 2 or another method")
    with ActivationStore(store_kind, handle.device, offload_dir) as store:
        program = LayerProgram(handle, batches, store, num_layers - 1)
        streams: dict[int | None, list[torch.Tensor]] = {None: [program.hidden(n) for n in range(len(batches))]}
        for index in bar(range(num_layers), desc=f"scoring merges of {merged + 1} blocks", unit="layer", leave=False):
            if index in candidates:
                block = _merged_block(handle, index, merged)
                streams[index] = [program.run_in_place_of(index, block, h, n) for n, h in enumerate(streams[None])]
                del block
            if index == candidates[-1]:
                streams.pop(None)  # no later merge branches off the unmerged stream
            with program.layer(index) as (_, run):
                for first, hidden in streams.items():
                    if first is None or index > first + merged:
                        streams[first] = [run(h, n) for n, h in enumerate(hidden)]
        scores = {}
        for first, hidden in streams.items():
            cosines = [torch.nn.functional.cosine_similarity(h[batch.attention_mask.bool().to(h.device)].double(),
                                                             want.to(h.device).double(), dim=-1)
                       for h, batch, want in zip(hidden, batches, reference)]
            scores[first] = float(torch.cat(cosines).mean())
    return scores


def collapse(handle: ModelHandle, first: int, merged: int) -> None:
    """Merge blocks ``first+1..first+merged`` into block ``first`` as recorded edits, then remove them."""
    for (owner, attr), delta in collapse_deltas(handle, first, merged).items():
        handle.transform(owner, attr, lambda weight, delta=delta: weight + delta.to(weight.device))
    remove_blocks(handle.model, handle.adapter, list(range(first + 1, first + merged + 1)))


def compress_laco(job: Job) -> dict:
    settings: LaCo = job.settings
    remaining = settings.num_blocks(job.num_layers)
    batches = job.calibration.first_sequences(settings.similarity_sequences)
    original_index = list(range(job.num_layers))
    store_kind, offload_dir = job.runner.store_kind(batches), job.runner.execution.offload_dir
    reference = last_block_outputs(job.handle, batches, store_kind, offload_dir)
    job.runner.sweep()  # passes over LaCo's few sequences
    steps = []
    with bar(total=remaining, desc="LaCo", unit="block") as progress:
        while remaining:
            merged = min(settings.merge_layers - 1, remaining)
            scores = candidate_similarities(job.handle, batches, merged, reference, store_kind, offload_dir)
            job.runner.sweep()
            first = max(scores, key=scores.get)
            collapsed = original_index[first : first + merged + 1]
            logger.info("collapsing blocks %s into block %d (similarity %.4f)", collapsed[1:], collapsed[0], scores[first])
            steps.append({"into": collapsed[0], "collapsed": collapsed[1:], "similarity": scores[first],
                          "candidates": {original_index[b]: v for b, v in scores.items()}})
            collapse(job.handle, first, merged)
            del original_index[first + 1 : first + merged + 1]
            remaining -= merged
            progress.update(merged)
    return {
        "removed_blocks": sorted(b for step in steps for b in step["collapsed"]),
        "collapsed": [{"into": step["into"], "blocks": step["collapsed"]} for step in steps],
        "selection": {"criterion": "last_layer_cosine_to_original", "score": steps[-1]["similarity"],
                      "candidates": steps[0]["candidates"], "steps": steps,
                      "tokens": sum(int(b.attention_mask.sum()) for b in batches)},
    }


def plan_laco(context: PlanContext) -> MethodPlan:
    """LaCo's plan for ``--dry-run``: the reference pass, then per merge round one stream per candidate
    merge over its few sequences, in units of passes over the whole calibration set."""
    import math

    from blockfold.plan import MethodPlan, gib

    settings, num_layers, calibration = context.settings, context.num_layers, context.calibration
    remaining, layers, runs = settings.num_blocks(num_layers), num_layers, 0.0
    rounds = math.ceil(remaining / (settings.merge_layers - 1))
    while remaining:  # as compress_laco's rounds: C candidates, each its merged block and the blocks after it
        merged = min(settings.merge_layers - 1, remaining)
        candidates = layers - merged
        runs += (candidates - 1) + candidates * (candidates - 1) / 2 + candidates
        layers, remaining = layers - merged, remaining - merged
    share = calibration.share_of_first(settings.similarity_sequences)
    streams = num_layers * share * context.tokens * context.hidden_size * context.element
    return MethodPlan(passes=1 + rounds, extra_forward=share * (1 + runs / num_layers) - 1 - rounds,
                      notes=[f"{rounds} round(s), each one stream per candidate merge over "
                             f"{round(share * calibration.num_sequences)} sequences ({gib(streams)})"])
