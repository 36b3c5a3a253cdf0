"""SVD-LLM (Wang et al. 2025), a width baseline: every linear projection of the decoder blocks stored as
two low-rank factors, truncated where the projection's *output on calibration data* loses least.

Truncation-aware whitening: with ``C = Σ x xᵀ`` the second moment of what a projection reads and
``S`` its Cholesky factor (``S Sᵀ = C``), the SVD ``W S = U Σ Vᵀ`` orders directions by what they add
to the output on the data, so keeping ``r`` of them loses exactly ``Σ_{i>r} σ_i²`` of ``‖W X‖²``. The
factors are ``B = U_r Σ_r^½`` (out × r) and ``A = Σ_r^½ V_rᵀ S⁻¹`` (r × in). Without whitening, plain
SVD of ``W`` (the paper's baseline). Every matrix keeps the same share of its parameters, the rank
``⌊(1 − sparsity)·m·n / (m + n)⌋``, as the paper compresses at one ratio.

Composition: one pass over the original model (or one per group of layers whose sums fit the
statistics budget) for the float64 input moments → every factorization from the original weights →
the projections replaced at once (surgery/linearize.py), so no pass sees a half-compressed model.
The paper's optional parameter update (LoRA on the factors) is ``heal``'s job, not this stage's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from blockfold.errors import BlockfoldError
from blockfold.estimate.signs import column_signs
from blockfold.methods.base import Job
from blockfold.stats.covariance import InputCovariance
from blockfold.stats.sums import layer_groups
from blockfold.surgery import factor_projections

if TYPE_CHECKING:
    from blockfold.plan import MethodPlan, PlanContext

#: damping added to each input moment, relative to its mean diagonal, so the Cholesky factor exists
#: where some input direction never occurs in the calibration set (dead channels, few tokens)
DAMPING = 1e-6


def rank_for(out_features: int, in_features: int, sparsity: float) -> int:
    """The rank at which two factors hold ``1 - sparsity`` of an ``out × in`` matrix's parameters."""
    return max(1, math.floor((1.0 - sparsity) * out_features * in_features / (out_features + in_features)))


def input_widths(adapter, layer) -> list[int]:
    """The widths of one block's distinct projection inputs: what the attention's and the MLP's input
    projections read, and what their output projections read."""
    widths = [projections[0].in_features for sublayer in ("attention", "mlp")
              if (projections := adapter.input_projections(layer, sublayer))]
    return widths + [adapter.attention_output_projection(layer).module.in_features, adapter.down_proj(layer).in_features]


@torch.no_grad()
def factor(weight: torch.Tensor, rank: int, gram: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(A, B, lost)``: the rank-``rank`` factors of ``weight`` (out × in) with ``B @ A ≈ weight``, whitened
    by the input moment ``gram`` (in × in; None: plain SVD), and the share of ``‖W X‖²`` (of ``‖W‖²``
    unwhitened) the truncation loses. Float64 throughout."""
    w = weight.double()
    if gram is None:
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        first = vh[:rank]
    else:
        g = gram.double()
        damped = g + DAMPING * max(float(g.diagonal().mean()), 1e-30) * torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
        root, info = torch.linalg.cholesky_ex(damped)
        if int(info) != 0:
            raise BlockfoldError("an input moment of SVD-LLM's whitening is not finite or not positive definite: the "
                                 "calibration activations hold NaN or infinite values; check the model in float32")
        u, s, vh = torch.linalg.svd(w @ root, full_matrices=False)
        first = torch.linalg.solve_triangular(root, vh[:rank], upper=False, left=False)  # V_rᵀ S⁻¹
    signs = column_signs(u[:, :rank])  # each singular pair's sign fixed: the largest entry of u positive
    u, first = u[:, :rank] * signs, first * signs[:, None]
    half = s[:rank].sqrt()
    energy = float((s * s).sum())
    lost = float((s[rank:] * s[rank:]).sum()) / energy if energy > 0 else 0.0
    return half[:, None] * first, u * half[None, :], lost


def _layer_groups(job: Job, widths: list[int]) -> list[list[int]]:
    """The layers whose input moments one pass gathers: all at once where they fit the statistics budget."""
    per_layer = InputCovariance.sums_bytes_for(1, widths)
    groups = layer_groups(list(range(job.num_layers)), per_layer, job.runner.stats_budget())
    if len(groups) > 1:
        job.notes.update(stats_budget_bytes=job.runner.stats_budget(), full_sums_bytes=per_layer * job.num_layers,
                         layers_per_pass=len(groups[0]))
    return groups


def check_dense(adapter, model) -> None:
    """Refuse mixtures of experts: their experts are stacked parameters, not projections to factor."""
    if any(adapter.is_sparse(layer) for layer in adapter.layers(model)):
        raise BlockfoldError(f"svd-llm factors dense projections, and this {model.config.model_type} model's "
                             "mixture-of-experts blocks keep their experts stacked in one parameter: compress it with a "
                             "method that removes blocks (blockfold methods)")


def compress_svd_llm(job: Job) -> dict:
    settings, adapter, handle = job.settings, job.adapter, job.handle
    check_dense(adapter, job.model)
    layers = adapter.layers(job.model)
    projections = [adapter.linear_projections(layer) for layer in layers]
    moments: dict[int, InputCovariance] = {}
    if settings.whitening:
        widths = input_widths(adapter, layers[0])
        for group in _layer_groups(job, widths):
            observer = InputCovariance(job.num_layers, group, widths)
            job.run([observer], description="projection input moments"
                    + (f", layers {group[0]}-{group[-1]}" if len(group) < job.num_layers else ""))
            moments.update({index: observer for index in group})
    factors, ranks, lost = {}, {}, {}
    for index, named in enumerate(projections):
        for name, linear in named.items():
            rank = rank_for(linear.out_features, linear.in_features, settings.sparsity)
            gram = moments[index].covariance(index, name) if settings.whitening else None
            first, second, share = factor(handle.saved_value(linear, "weight"), rank, gram)
            factors[(index, name)] = (first.float(), second.float())
            ranks[name], lost[f"{index}.{name}"] = rank, share
        moments.pop(index, None)  # each layer's sums, once factored
    before = sum(linear.weight.numel() for named in projections for linear in named.values())
    factor_projections(handle, factors)
    after = sum(first.numel() + second.numel() for first, second in factors.values())
    return {
        "removed_blocks": [],
        "low_rank": {"whitening": settings.whitening, "ranks": ranks, "projection_parameters": [before, after],
                     "sparsity_of_projections": 1.0 - after / before},
        "selection": {"criterion": "whitened truncation" if settings.whitening else "truncation",
                      "score": sum(lost.values()) / len(lost), "lost_share": lost,
                      **({"statistics": dict(job.notes)} if job.notes else {})},
    }


def plan_svd_llm(context: PlanContext) -> MethodPlan:
    """SVD-LLM's plan for ``--dry-run``: the input moments of every layer, in one pass or one per group of
    layers that fits the budget; no pass without whitening."""
    from blockfold.plan import MethodPlan, gib

    check_dense(context.adapter, context.model)
    layers = context.adapter.layers(context.model)
    if not context.settings.whitening:
        return MethodPlan(passes=0, notes=["plain SVD of the weights: no calibration pass"])
    widths = input_widths(context.adapter, layers[0])
    per_layer = InputCovariance.sums_bytes_for(1, widths)
    groups = layer_groups(list(range(context.num_layers)), per_layer, context.budget)
    group = len(groups[0])
    plan = MethodPlan(passes=len(groups), sums=group * per_layer)
    plan.observers.append(InputCovariance(context.num_layers, groups[0], widths))
    plan.stats_flops_per_token = group * sum(2 * width * width for width in widths)
    plan.notes.append(f"input moments of {len(widths)} widths ({', '.join(map(str, widths))}) per layer, "
                      f"{gib(per_layer)} each, {group} layer(s) per pass")
    return plan


__all__ = ["compress_svd_llm", "factor", "plan_svd_llm", "rank_for"]
