"""Folding a linear map on a block's MLP output into its down-projection, as recorded edits."""

from __future__ import annotations

import torch
from torch import nn

from blockfold.adapters import Projection
from blockfold.models.handle import ModelHandle


def fold_into_projection(handle: ModelHandle, projection: Projection, transform: torch.Tensor) -> None:
    """Make ``projection`` output ``y @ T`` where it output ``y``, exactly, in float64: ``W ← Tᵀ W``
    along a hidden axis of -2 (``nn.Linear``, stacked experts), ``W ← W T`` along -1, ``b ← b T``."""
    t = transform.detach().double()
    if projection.hidden_axis == -2:
        handle.transform(projection.module, projection.weight, lambda weight: t.to(weight.device).T @ weight)
    else:
        handle.transform(projection.module, projection.weight, lambda weight: weight @ t.to(weight.device))
    if projection.bias is not None and getattr(projection.module, projection.bias, None) is not None:
        handle.transform(projection.module, projection.bias, lambda bias: bias @ t.to(bias.device))


def fold_into_mlp_output(handle: ModelHandle, layer: nn.Module, transform: torch.Tensor) -> None:
    """Fold a map on what ``layer``'s MLP adds to the residual stream into every weight that
    produces it (the down-projection; every expert's and the shared expert's in a mixture)."""
    for projection in handle.adapter.mlp_output_projections(layer):
        fold_into_projection(handle, projection, transform)


def fold_into_down_proj(handle: ModelHandle, down_proj: nn.Linear, transform: torch.Tensor) -> None:
    """Make ``down_proj`` compute ``down_proj(a) @ T``: ``W ← Tᵀ W`` and ``b ← b T``, exactly, in float64."""
    fold_into_projection(handle, Projection(down_proj), transform)


#: how far below the norm's epsilon the folded activations stay, in RMS: the linearisation's
#: relative error is at most 1 / (2 · headroom²) for tokens like the calibration tokens
LINEAR_NORM_HEADROOM = 1e3


def fold_through_linearized_norm(
    handle: ModelHandle, down_proj: nn.Linear, norm: nn.Module, transform: torch.Tensor, output_max_rms: float,
) -> float:
    """Make ``norm(down_proj(a))`` compute ``down_proj(a) @ T`` for an RMSNorm after ``down_proj``.

    RMSNorm(v) = g ⊙ v / sqrt(mean(v²) + ε) is linear, g ⊙ v / sqrt(ε), when mean(v²) ≪ ε. Scaling
    the folded down-projection by c (so that the largest calibration output has RMS sqrt(ε)/headroom)
    and setting g = sqrt(ε)/c gives ``z T`` up to a relative error below 1/(2·headroom²); larger
    inputs are softly bounded by the norm instead of growing without limit. Returns c.
    """
    adapter = handle.adapter
    eps = adapter.norm_eps(norm)
    c = (eps**0.5) / (LINEAR_NORM_HEADROOM * max(output_max_rms, 1e-30))
    fold_into_down_proj(handle, down_proj, transform.double() * c)
    weight = (eps**0.5) / c - adapter.norm_weight_offset
    handle.transform(norm, "weight", lambda current: torch.full_like(current, weight))
    return c


def scale_block_output(handle: ModelHandle, layer: nn.Module, factor: float) -> None:
    """Make everything ``layer`` adds to the residual stream ``factor`` times as large, exactly: the
    gain of a norm that ends a sublayer (Gemma's post-norms), else the output projections' weights
    and biases (every expert's in a mixture)."""
    adapter = handle.adapter
    norms, projections = adapter.residual_writers(layer)
    offset = adapter.norm_weight_offset
    for norm in norms:
        handle.transform(norm, "weight", lambda weight: (weight + offset) * factor - offset)
    for projection in projections:
        handle.transform(projection.module, projection.weight, lambda weight: weight * factor)
        if projection.bias is not None and getattr(projection.module, projection.bias, None) is not None:
            handle.transform(projection.module, projection.bias, lambda bias: bias * factor)
