"""Numerical fits of the span-replacing map on a bounded token subsample.

Used for the cosine objective (ReplaceMe's numerical variant) and, for sandwich-norm blocks, to fit
the map *through* the post-MLP norm so that what is folded into ``down_proj`` is what is optimised.
L-BFGS with a strong-Wolfe line search, started from the closed-form solution: on these problems it
converges in tens of iterations where first-order methods with fixed learning rates stall.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Literal

import torch

from blockfold.progress import bar
from blockfold.settings import CosineConfig
from blockfold.stats import SpanRows

logger = logging.getLogger(__name__)

Contribution = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def linear_contribution(x: torch.Tensor, transform: torch.Tensor) -> torch.Tensor:
    return x @ transform


def span_loss(rows: SpanRows, transform: torch.Tensor, contribution: Contribution, objective: str) -> torch.Tensor:
    prediction = rows.attn_residual + contribution(rows.x, transform)
    if objective == "cosine":
        return (1 - torch.nn.functional.cosine_similarity(prediction, rows.target, dim=-1)).mean()
    residual = prediction - rows.target
    return (residual * residual).sum() / (rows.target - rows.attn_residual).pow(2).sum()


def fit_numerically(
    rows: SpanRows,
    init: torch.Tensor,
    config: CosineConfig,
    objective: Literal["cosine", "mse"] = "cosine",
    contribution: Contribution = linear_contribution,
) -> tuple[torch.Tensor, dict]:
    """Minimise ``objective`` (plus ``config.l1_penalty``·Σ|T|/d) over the transform, from ``init``;
    float32 on ``init``'s device (the sample is moved there). The losses reported exclude the penalty."""
    rows = rows.to(init.device)
    transform = init.float().contiguous().clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS(
        [transform], lr=config.learning_rate, max_iter=config.steps, history_size=20,
        line_search_fn="strong_wolfe", tolerance_grad=1e-9, tolerance_change=1e-12,
    )

    progress = bar(desc=f"fitting ({objective})", unit="eval", leave=False)

    penalty = config.l1_penalty / transform.shape[0]
    best = {"loss": float("inf"), "transform": transform.detach().clone()}

    def closure():
        optimizer.zero_grad()
        loss = span_loss(rows, transform, contribution, objective)
        if penalty:
            loss = loss + penalty * transform.abs().sum()
        loss.backward()
        progress.update(1)
        value = float(loss.detach())
        if math.isfinite(value) and value < best["loss"]:  # every point the line search visits
            best.update(loss=value, transform=transform.detach().clone())
        return loss

    with torch.no_grad():
        initial = float(span_loss(rows, transform, contribution, objective))
    diverged = None
    with torch.enable_grad():
        try:
            optimizer.step(closure)
        except RuntimeError as err:  # the line search's step overflowed float32 ("without overflow")
            diverged = str(err).splitlines()[0]
    progress.close()
    with torch.no_grad():
        final = float(span_loss(rows, transform, contribution, objective))
        if diverged is None and not (math.isfinite(final) and torch.isfinite(transform).all()):
            diverged = "the loss or the map became non-finite"
        if diverged is not None:  # keep the best point reached, never a broken map
            logger.warning("numerical fit (%s) diverged (%s): keeping its best point, loss %.4g from %.4g",
                           objective, diverged, best["loss"], initial)
            transform.copy_(best["transform"])
            final = float(span_loss(rows, transform, contribution, objective))
    info = {"objective": objective, "sample_tokens": rows.x.shape[0], "loss_start": initial, "loss_end": final,
            "l1_penalty": config.l1_penalty, **({"diverged": diverged} if diverged else {})}
    return transform.detach().double(), info
