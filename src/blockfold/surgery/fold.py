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
