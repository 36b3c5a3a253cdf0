"""Folding a linear map on a block's MLP output into its down-projection."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def fold_into_down_proj(down_proj: nn.Linear, transform: torch.Tensor) -> None:
    """Make ``down_proj`` compute ``down_proj(a) @ T``: ``W ← Tᵀ W`` and ``b ← b T``, exactly.

    The product is formed in float64 and cast back to the layer's own dtype.
    """
    t = transform.to(device=down_proj.weight.device, dtype=torch.float64)
    weight = t.T @ down_proj.weight.double()
    down_proj.weight.copy_(weight.to(down_proj.weight.dtype))
    if down_proj.bias is not None:
        down_proj.bias.copy_((down_proj.bias.double() @ t).to(down_proj.bias.dtype))


#: how far below the norm's epsilon the folded activations stay, in RMS: the linearisation's
#: relative error is at most 1 / (2 · headroom²) for tokens like the calibration tokens
LINEAR_NORM_HEADROOM = 1e3


@torch.no_grad()
def fold_through_linearized_norm(
    down_proj: nn.Linear, norm: nn.Module, transform: torch.Tensor, output_max_rms: float,
    eps: float, set_scale,
) -> float:
    """Make ``norm(down_proj(a))`` compute ``down_proj(a) @ T`` for an RMSNorm after ``down_proj``.

    RMSNorm(v) = g ⊙ v / sqrt(mean(v²) + ε) is linear, g ⊙ v / sqrt(ε), when mean(v²) ≪ ε. Scaling
    the folded down-projection by c (so that the largest calibration output has RMS sqrt(ε)/headroom)
    and setting g = sqrt(ε)/c gives ``z T`` up to a relative error below 1/(2·headroom²); larger
    inputs are softly bounded by the norm instead of growing without limit. Returns c.
    """
    c = (eps**0.5) / (LINEAR_NORM_HEADROOM * max(output_max_rms, 1e-30))
    fold_into_down_proj(down_proj, transform.double() * c)
    set_scale(norm, (eps**0.5) / c)
    return c
