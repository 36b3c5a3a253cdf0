"""ReplaceMe: remove the span of blocks that changes the residual stream least, fold one linear map.

Composition: one streaming pass (span distances + normal equations for every candidate start) →
pick the span → closed-form fit (and, for the cosine objective or sandwich norms, a second,
truncated pass for a token subsample) → fold into the down-projection of the block before the
span → delete the span.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockfold.adapters import DecoderAdapter, get_adapter
from blockfold.data import CalibrationSet
from blockfold.estimate import fit_lstsq, fit_numerically, linear_contribution, span_loss
from blockfold.recipe import Recipe
from blockfold.select import best_span
from blockfold.stats import NormalEquations, SpanSample, SpanStatistics, stream_activations
from blockfold.surgery import fold_into_down_proj, fold_through_linearized_norm, remove_blocks


@dataclass
class FittedMap:
    transform: torch.Tensor
    info: dict
    # sandwich blocks only: "linearized-norm" (T on the down-projection output, norm made linear)
    # or "through-norm" (B before the norm, fitted with the norm in the loop)
    regime: str = "exact"
    output_max_rms: float = 0.0


def _fit_prenorm(model, adapter, recipe, calibration, start, length, equations: NormalEquations) -> FittedMap:
    """Pre-norm blocks: T acts on the MLP contribution and folds into down_proj exactly."""
    transform, info = fit_lstsq(equations, recipe.ridge_alpha)
    if recipe.estimator == "identity":  # plain removal of the span, for comparison
        identity = torch.eye(transform.shape[0], dtype=torch.float64)
        return FittedMap(identity, {**info, "estimator": "identity", "relative_fit_error": equations.relative_residual(identity)})
    if recipe.estimator == "cosine":
        sample = SpanSample(start, length, recipe.cosine.max_tokens, calibration.num_tokens, pre_norm=False,
                            seed=recipe.calibration.seed)
        stream_activations(model, adapter, calibration, [sample], description="sampling span rows")
        transform, info["numerical_fit"] = fit_numerically(sample.rows(), transform, recipe.cosine, "cosine")
        info["relative_fit_error"] = equations.relative_residual(transform)
        info["estimator"] = "cosine"
    return FittedMap(transform, info)


def _fit_sandwich(model, adapter: DecoderAdapter, recipe, calibration, start, length, equations) -> FittedMap:
    """Sandwich blocks: a post-MLP norm sits between down_proj and the residual (docs/gemma.md).

    Two exact-to-fold regimes are fitted and the one with the lower loss on the token sample kept:
    ``linearized-norm`` fits T on the down-projection output z (closed form over all tokens) and
    makes the norm linear; ``through-norm`` folds B = diag(g) T diag(1/g) from the post-norm fit
    and refits B with the norm in the loop.
    """
    if recipe.estimator == "identity":
        error = equations.relative_error_identity()
        return FittedMap(torch.eye(adapter.hidden_size(model), dtype=torch.float64),
                         {"estimator": "identity", "relative_fit_error": error, "relative_error_plain_removal": error})
    num_layers = adapter.num_layers(model)
    sample = SpanSample(start, length, recipe.cosine.max_tokens, calibration.num_tokens, pre_norm=True,
                        seed=recipe.calibration.seed)
    z_statistics = SpanStatistics(num_layers, 0, length, starts=[start], inputs="down_out")
    stream_activations(model, adapter, calibration, [sample, z_statistics], description="sampling span rows")
    rows = sample.rows()
    z_equations = z_statistics.finalize().normal_equations[start]
    objective = "cosine" if recipe.estimator == "cosine" else "mse"

    post_norm_transform, info = fit_lstsq(equations, recipe.ridge_alpha)
    info = {"estimator": recipe.estimator, "post_norm_space_relative_error": info["relative_fit_error"],
            "relative_error_plain_removal": info["relative_error_plain_removal"], "tokens": info["tokens"]}

    linear, linear_info = fit_lstsq(z_equations, recipe.ridge_alpha)
    if objective == "cosine":
        linear, linear_info["numerical_fit"] = fit_numerically(rows, linear, recipe.cosine, objective)
    linear_info["relative_fit_error"] = z_equations.relative_residual(linear)

    norm = adapter.mlp_norm(adapter.layers(model)[start - 1])
    scale = adapter.norm_scale(norm)
    through_norm = lambda z, b: norm(z @ b)  # noqa: E731 - the MLP contribution with B folded before the norm
    through, through_info = fit_numerically(rows, scale[:, None] * post_norm_transform / scale[None, :],
                                            recipe.cosine, objective, through_norm)

    with torch.no_grad():
        losses = {"linearized-norm": float(span_loss(rows, linear.float(), linear_contribution, objective)),
                  "through-norm": through_info["loss_end"]}
    regime = min(losses, key=losses.get) if recipe.sandwich_fold == "auto" else recipe.sandwich_fold
    info.update({"regime": regime, "sample_loss_per_regime": losses, "objective": objective,
                 "linearized_norm": linear_info, "through_norm": through_info})
    if regime == "linearized-norm":
        info["relative_fit_error"] = linear_info["relative_fit_error"]
        output_rms = float((rows.x.double() @ linear).pow(2).mean(-1).sqrt().max())
        return FittedMap(linear, info, regime, output_rms)
    with torch.no_grad():  # relative squared error on the sample, whatever the objective was
        info["relative_fit_error"] = float(span_loss(rows, through.float(), through_norm, "mse"))
    return FittedMap(through, info, regime)


def _fold(model, adapter: DecoderAdapter, block: int, fitted: FittedMap) -> None:
    layer = adapter.layers(model)[block]
    down_proj = adapter.down_proj(layer)
    if fitted.regime == "linearized-norm":
        norm = adapter.mlp_norm(layer)
        fitted.info["linearized_norm"]["down_proj_scale"] = fold_through_linearized_norm(
            down_proj, norm, fitted.transform, fitted.output_max_rms, adapter.norm_eps(norm), adapter.set_norm_scale)
    elif fitted.info.get("estimator") != "identity":
        fold_into_down_proj(down_proj, fitted.transform)


def compress_replaceme(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, calibration: CalibrationSet
) -> dict:
    adapter = get_adapter(model)
    num_layers = adapter.num_layers(model)
    length = recipe.num_blocks_to_remove(num_layers)
    statistics = SpanStatistics(num_layers, max_length=length, fit_length=length)
    stream_activations(model, adapter, calibration, [statistics])
    table = statistics.finalize()
    choice = best_span(table.criterion(recipe.criterion), length, recipe.criterion, fixed_start=recipe.span_start)
    fit = _fit_prenorm if adapter.folds_exactly else _fit_sandwich
    fitted = fit(model, adapter, recipe, calibration, choice.start, length, table.normal_equations[choice.start])
    _fold(model, adapter, choice.start - 1, fitted)
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
                start: fit_lstsq(eq, recipe.ridge_alpha, warn=False)[1]["relative_fit_error"]
                for start, eq in table.normal_equations.items()
            },
            "span_distances": {name: _table(getattr(table, name)) for name in ("angular_last", "angular_all", "cosine_all")},
        },
        "transform": fitted.info,
    }


def _table(values) -> dict[str, dict[str, float]]:
    """``{length: {start: value}}`` for JSON, dropping spans that do not fit."""
    return {
        str(length): {str(start): float(values[start, length]) for start in range(values.shape[0])
                      if values[start, length] == values[start, length]}
        for length in range(1, values.shape[1])
    }
