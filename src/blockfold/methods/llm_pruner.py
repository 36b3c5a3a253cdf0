"""LLM-Pruner (Ma et al. 2023), a width baseline: coupled structures of the middle blocks (a key-value group
of attention heads with its query heads and their output columns; an MLP channel with its gate and up
rows and its down column) pruned by the first-order Taylor importance of their weights, ``Σ |w · ∂L/∂w|``,
on the calibration set's next-token loss. No weight is updated: the paper's LoRA recovery is ``heal``.

Every pruned block loses the same share of its parameters, chosen so the blocks together lose
``sparsity`` of theirs; as in the paper (LLaMA-7B: blocks 4-29 of 32) the first eighth and the last
sixteenth of the blocks stay whole. Whole key-value groups go, so the ratio of query to key-value heads,
which the attention reads from the config, holds in every block; a block whose groups are too few to
take its share from the attention takes the rest from its MLP.

The gradients need the whole model resident (a backward pass through it), like healing: layer by layer
runs are refused. Under torchrun every process computes them on the whole calibration set, so all agree.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from blockfold.errors import BlockfoldError
from blockfold.methods.base import Job
from blockfold.surgery import prune_projections

if TYPE_CHECKING:
    from blockfold.plan import MethodPlan, PlanContext

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def pruned_layers(num_layers: int) -> list[int]:
    """The blocks pruned: all but the first eighth and the last sixteenth (rounded up)."""
    return list(range(math.ceil(num_layers / 8), num_layers - math.ceil(num_layers / 16)))


def _projections(adapter, layer) -> dict[str, torch.nn.Linear]:
    attention, mlp = adapter.attention(layer), adapter.mlp(layer)
    return {**{f"{adapter.attention_attr}.{name}": getattr(attention, name, None) for name in ATTENTION},
            **{f"{adapter.mlp_attr}.{name}": getattr(mlp, name, None) for name in MLP}}


def check_prunable(adapter, model, pipeline: str) -> None:
    """Refuse, in one line naming the reason, what the method cannot prune."""
    layers = adapter.layers(model)
    if any(adapter.is_sparse(layer) for layer in layers):
        raise BlockfoldError(f"llm-pruner prunes dense blocks, and this {model.config.model_type} model's "
                             "mixture-of-experts blocks keep their experts stacked in one parameter: compress it with "
                             "a method that removes blocks (blockfold methods)")
    if any(not isinstance(module, torch.nn.Linear) for layer in layers for module in _projections(adapter, layer).values()):
        raise BlockfoldError(f"llm-pruner needs separate q, k, v, o and gate, up, down projections, and this "
                             f"{model.config.model_type} model fuses or names them otherwise: compress it with another "
                             "method (blockfold methods)")
    if pipeline != "whole":
        raise BlockfoldError("llm-pruner's importance needs gradients through the whole model in memory, and this "
                             "one runs layer by layer: use --pipeline whole where it fits")


def _head_layout(config) -> tuple[int, int, int]:
    """(key-value groups, query heads per group, head size)."""
    heads = config.num_attention_heads
    groups = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return groups, heads // groups, head_dim


def _gradients(job: Job, weights: list[torch.nn.Parameter]) -> None:
    """Accumulate ``∂L/∂w`` of the mean next-token loss over the calibration set into each weight's ``.grad``."""
    model, device = job.model, job.handle.device
    batches = [batch.rows(row, row + 1) for batch in job.calibration for row in range(len(batch))]
    tokens = sum(int((batch.attention_mask[:, 1:].bool() & batch.attention_mask[:, :-1].bool()).sum())
                 for batch in batches)
    flags = {name: param.requires_grad for name, param in model.named_parameters()}
    try:
        for param in model.parameters():
            param.requires_grad_(False)
        for weight in weights:
            weight.requires_grad_(True)
            weight.grad = None
        with torch.enable_grad():
            for batch in batches:
                ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
                logits = model(input_ids=ids, attention_mask=mask, position_ids=batch.position_ids.to(device),
                               use_cache=False).logits[:, :-1].float()
                keep = mask[:, 1:].bool() & mask[:, :-1].bool()
                loss = F.cross_entropy(logits[keep], ids[:, 1:][keep], reduction="sum") / tokens
                loss.backward()
    finally:
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])


def _importance(weight: torch.nn.Parameter) -> torch.Tensor:
    """``|w · ∂L/∂w|`` per entry, float64 on the CPU."""
    return (weight.detach().double() * weight.grad.double()).abs().cpu()


def compress_llm_pruner(job: Job) -> dict:
    settings, adapter, handle, model = job.settings, job.adapter, job.handle, job.model
    check_prunable(adapter, model, job.runner.pipeline)
    layers = adapter.layers(model)
    chosen = pruned_layers(job.num_layers)
    projections = {index: _projections(adapter, layers[index]) for index in chosen}
    _gradients(job, [linear.weight for named in projections.values() for linear in named.values()])
    groups, per_group, head_dim = _head_layout(model.config)
    block_parameters = sum(param.numel() for param in layers.parameters())
    prunable = sum(linear.weight.numel() for named in projections.values() for linear in named.values())
    if settings.sparsity * block_parameters >= prunable:
        raise BlockfoldError(f"llm-pruner cannot remove {settings.sparsity:.0%} of the blocks' parameters from the "
                             f"{len(chosen)} blocks it prunes: give a --sparsity below {prunable / block_parameters:.2f}")
    share = settings.sparsity * block_parameters / prunable  # of each pruned block's projections
    kept, decisions = {}, {}
    for index, named in projections.items():
        q, k, v, o, gate, up, down = named.values()
        names = list(named)
        width = q.in_features
        group_rows = per_group * head_dim
        attention = (_importance(q.weight).view(groups, group_rows, -1).sum((1, 2))
                     + _importance(k.weight).view(groups, head_dim, -1).sum((1, 2))
                     + _importance(v.weight).view(groups, head_dim, -1).sum((1, 2))
                     + _importance(o.weight).view(o.out_features, groups, group_rows).sum((0, 2)))
        channels = (_importance(gate.weight).sum(1) + _importance(up.weight).sum(1) + _importance(down.weight).sum(0))
        per_group_parameters = 2 * width * group_rows + 2 * width * head_dim
        target = share * sum(linear.weight.numel() for linear in named.values())
        drop_groups = min(groups - 1, math.floor(share * groups + 0.5))
        drop_channels = min(gate.out_features - 1, max(0, round((target - drop_groups * per_group_parameters) / (3 * width))))
        keep_groups = torch.sort(torch.argsort(attention, descending=True)[: groups - drop_groups]).values
        keep_channels = torch.sort(torch.argsort(channels, descending=True)[: gate.out_features - drop_channels]).values
        query_rows = (keep_groups[:, None] * group_rows + torch.arange(group_rows)).reshape(-1)
        head_rows = (keep_groups[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)
        kept.update({(index, names[0]): (query_rows, None), (index, names[1]): (head_rows, None),
                     (index, names[2]): (head_rows, None), (index, names[3]): (None, query_rows),
                     (index, names[4]): (keep_channels, None), (index, names[5]): (keep_channels, None),
                     (index, names[6]): (None, keep_channels)})
        total = float(attention.sum() + channels.sum())
        lost = total - float(attention[keep_groups].sum() + channels[keep_channels].sum())
        decisions[index] = {"groups_kept": keep_groups.tolist(), "channels_kept": len(keep_channels),
                            "importance_lost": lost / total if total > 0 else 0.0}
    for named in projections.values():
        for linear in named.values():
            linear.weight.grad = None
    prune_projections(handle, kept)
    return {
        "removed_blocks": [],
        "pruned": {"layers": chosen, "key_value_groups": groups, "query_heads_per_group": per_group,
                   "intermediate_size": projections[chosen[0]][f"{adapter.mlp_attr}.gate_proj"].out_features,
                   "blocks": decisions},
        "selection": {"criterion": "taylor",
                      "score": sum(entry["importance_lost"] for entry in decisions.values()) / len(decisions)},
    }


def plan_llm_pruner(context: PlanContext) -> MethodPlan:
    """LLM-Pruner's plan for ``--dry-run``: no pipeline pass, one forward and backward of the calibration set
    through the whole model for the gradients."""
    from blockfold.plan import MethodPlan

    check_prunable(context.adapter, context.model, context.pipeline)
    plan = MethodPlan(passes=0, extra_forward=1.0)
    plan.notes.append(f"gradients of the next-token loss: one forward and backward of the calibration set through the "
                      f"whole model; blocks {pruned_layers(context.num_layers)[0]}-{pruned_layers(context.num_layers)[-1]} "
                      "pruned")
    return plan


__all__ = ["compress_llm_pruner", "plan_llm_pruner", "pruned_layers"]
