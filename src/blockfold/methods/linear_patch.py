"""LinearPatch (Chen et al., NeurIPS 2025): remove the span of blocks whose input and output are most
alike, and bridge the gap with one linear patch on the whole residual stream, ``h ← h P``.

The paper's patch is ``P = H D Hᵀ``: ``H`` an orthonormal Hadamard matrix, which spreads the few
massive-activation channels over all of them, and ``D`` diagonal, each rotated channel's mean absolute
value after the span over the one before it (``--patch hadamard``, the default). ``--patch full`` fits
``P`` by least squares instead, ``h[end] ≈ h[start] P``: the closed-form map on the residual stream at
the boundary, ``P = I + X⁺Δ`` with ``Δ`` the span's change of the stream, that several 2026 papers use.

The patch acts on the residual stream itself, skip connection included, so unlike ReplaceMe's map it
folds into no existing weight: the first removed block becomes a linear block, ``h + h (P − I)``
(NBL-block's form, shipped as modeling code; no KV cache for it), and the others go. That is ``d²``
parameters and one ``d × d`` product per token more than plain removal; docs/new-methods.md says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from blockfold.estimate.hadamard import hadamard
from blockfold.estimate.lstsq import solve_normal_equations
from blockfold.methods.base import Job
from blockfold.select import best_span, by_start, span_criteria
from blockfold.settings import LinearPatch
from blockfold.stats import SpanStatistics
from blockfold.stats.magnitude import BoundaryEquations, StreamMagnitude
from blockfold.surgery import remove_blocks, replace_sublayers

if TYPE_CHECKING:
    from blockfold.plan import MethodPlan, PlanContext


def hadamard_patch(before: torch.Tensor, after: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """``H diag(after / before) Hᵀ`` from the rotated channels' mean absolute values at the two boundaries."""
    scale = after / before.clamp_min(torch.finfo(torch.float64).tiny)
    rotation = hadamard(scale.shape[0]).to(scale.device)
    info = {"scale_min": float(scale.min()), "scale_mean": float(scale.mean()), "scale_max": float(scale.max())}
    return (rotation * scale) @ rotation.T, info


def compress_linear_patch(job: Job) -> dict:
    settings: LinearPatch = job.settings
    count = settings.num_blocks(job.num_layers)
    distances = SpanStatistics(job.num_layers, max_length=count)
    job.run([distances], description="span distances")
    scores = span_criteria(distances.finalize(), [], None, None)
    choice = best_span(scores[settings.criterion], count, settings.criterion, fixed_start=settings.span_start)
    start, end = choice.start, choice.start + count
    equations = BoundaryEquations(start, end)
    observers = [equations]
    if settings.patch == "hadamard":
        magnitudes = StreamMagnitude(job.num_layers, [start, end], rotated=True)
        observers.append(magnitudes)
    job.run(observers, description="patch statistics")
    sums = equations.finalize()
    if settings.patch == "hadamard":
        rotated = magnitudes.finalize()
        patch, info = hadamard_patch(rotated[start], rotated[end])
    else:
        patch, ridge = solve_normal_equations(sums.xtx, sums.xty, settings.ridge_alpha * sums.tokens)
        info = {"ridge_alpha": ridge / max(sums.tokens, 1)}
    info.update(form=settings.patch, relative_fit_error=sums.relative_residual(patch),
                relative_error_plain_removal=sums.relative_error_identity(), tokens=sums.tokens)
    identity = torch.eye(patch.shape[0], dtype=torch.float64, device=patch.device)
    remove_blocks(job.model, job.adapter, list(range(start + 1, end)))
    replace_sublayers(job.handle, [job.adapter.block_replacement(start)],
                      {start: ((patch - identity).T, torch.zeros(patch.shape[0], dtype=torch.float64))})
    return {
        "removed_blocks": list(range(start, end)),
        "patch": {"block": start, **info},
        "selection": {"criterion": settings.criterion, "start": start, "length": count, "score": choice.score,
                      "candidates": by_start(scores[settings.criterion], count),
                      "scores_per_criterion": {name: by_start(scores[name], count)
                                               for name in ("angular_last", "angular_all", "block_influence")}},
    }


def plan_linear_patch(context: PlanContext) -> MethodPlan:
    """LinearPatch's plan for ``--dry-run``: span distances, then the chosen span's boundary sums."""
    from blockfold.plan import MethodPlan

    settings, num_layers, d = context.settings, context.num_layers, context.hidden_size
    n = settings.num_blocks(num_layers)
    hadamard = settings.patch == "hadamard"
    return MethodPlan(passes=2, sums=2 * d * d * 8, stats_flops_per_token=4 * d * d + (2 * d * d if hadamard else 0),
                      observers=[SpanStatistics(num_layers, n), BoundaryEquations(1, 1 + n)],
                      notes=["span distances, then the chosen span's boundary normal equations"
                             + (" and rotated magnitudes" if hadamard else "")])
