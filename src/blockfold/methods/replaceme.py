"""ReplaceMe: remove the span of blocks that changes the residual stream least, fold one linear map.

Composition: one streaming pass (span distances + normal equations for every candidate start) →
pick the span → closed-form fit (and, for the cosine objective or sandwich norms, a numerical fit
on a token subsample from a second, truncated pass) → fold into the down-projection of the block
before the span → delete the span.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockfold.adapters import DecoderAdapter, get_adapter
from blockfold.data import CalibrationSet
from blockfold.estimate import fit_lstsq, fit_numerically
from blockfold.recipe import Recipe
from blockfold.select import best_span
from blockfold.stats import SpanSample, SpanStatistics, stream_activations
from blockfold.surgery import fold_into_down_proj, remove_blocks


def _through_norm_contribution(norm: torch.nn.Module):
    """``z ↦ norm(z B)``: the MLP contribution when B is folded before a post-MLP norm."""

    def contribution(z: torch.Tensor, transform: torch.Tensor) -> torch.Tensor:
        return norm(z @ transform)

    return contribution


def _fit_transform(model, adapter: DecoderAdapter, recipe: Recipe, calibration, start: int, length: int, equations):
    """The map to fold into ``down_proj`` of block ``start - 1`` and a record of how it was fitted."""
    transform, info = fit_lstsq(equations, recipe.ridge_alpha)
    if recipe.estimator == "lstsq" and adapter.folds_exactly:
        return transform, info
    sample = SpanSample(start, length, recipe.cosine.max_tokens, calibration.num_tokens,
                        pre_norm=not adapter.folds_exactly, seed=recipe.calibration.seed)
    stream_activations(model, adapter, calibration, [sample], description="sampling span rows")
    rows = sample.rows()
    objective = "cosine" if recipe.estimator == "cosine" else "mse"
    if adapter.folds_exactly:
        transform, info["numerical_fit"] = fit_numerically(rows, transform, recipe.cosine, objective)
    else:
        # The closed-form T acts after the post-MLP norm (scale g). B = diag(g) T diag(1/g) before the
        # norm reproduces T's direction per token; refit B with the norm in the loop so the folded
        # weights are what is optimised (docs/gemma.md).
        norm = adapter.mlp_norm(adapter.layers(model)[start - 1])
        scale = adapter.norm_scale(norm)
        init = scale[:, None] * transform / scale[None, :]
        transform, info["numerical_fit"] = fit_numerically(
            rows, init, recipe.cosine, objective, _through_norm_contribution(norm)
        )
        info["folded_before_post_mlp_norm"] = True
    info["estimator"] = recipe.estimator
    return transform, info


def compress_replaceme(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, calibration: CalibrationSet
) -> dict:
    adapter = get_adapter(model)
    num_layers = adapter.num_layers(model)
    length = recipe.num_blocks_to_remove(num_layers)
    statistics = SpanStatistics(num_layers, max_length=length, fit_length=length)
    stream_activations(model, adapter, calibration, [statistics])
    table = statistics.finalize()
    choice = best_span(table.criterion(recipe.criterion), length, recipe.criterion)
    transform, fit = _fit_transform(
        model, adapter, recipe, calibration, choice.start, length, table.normal_equations[choice.start]
    )
    fold_into_down_proj(adapter.down_proj(adapter.layers(model)[choice.start - 1]), transform)
    remove_blocks(model, adapter, choice.blocks)
    return {
        "removed_blocks": choice.blocks,
        "transform_folded_into_block": choice.start - 1,
        "selection": {
            "criterion": choice.criterion,
            "start": choice.start,
            "length": length,
            "score": choice.score,
            "candidates": choice.candidates,
            "lstsq_relative_error_per_candidate": {
                start: fit_lstsq(eq, recipe.ridge_alpha)[1]["relative_fit_error"]
                for start, eq in table.normal_equations.items()
            },
            "span_distances": {name: _table(getattr(table, name)) for name in ("angular_last", "angular_all", "cosine_all")},
        },
        "transform": fit,
    }


def _table(values) -> dict[str, dict[str, float]]:
    """``{length: {start: value}}`` for JSON, dropping spans that do not fit."""
    return {
        str(length): {str(start): float(values[start, length]) for start in range(values.shape[0])
                      if values[start, length] == values[start, length]}
        for length in range(1, values.shape[1])
    }
