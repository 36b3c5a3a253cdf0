"""ReplaceMe: remove the span of blocks a linear map replaces best, fold the map into the block before.

Composition: one streaming pass (span distances, stream moments and normal equations for every
candidate start) → every selection criterion for every span → pick the span(s) → fit the map (closed
form from the normal equations; the cosine objective and sandwich norms take a second, truncated
pass for a token subsample) → fold into the down-projection of the block before the span → delete
the span.

Several spans (``spans=k``) share the budget and are chosen together from the first pass; they are
then replaced shallowest first, each later span's map refitted on the model as already compressed
(one truncated pass each). ``greedy`` removes one block per round, the one the criterion scores best
after its own fix, with one pass per round.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from blockfold.adapters import DecoderAdapter, get_adapter
from blockfold.data import CalibrationSet
from blockfold.estimate import fit_lstsq, fit_numerically, fit_span_map, linear_contribution, span_loss
from blockfold.recipe import Recipe
from blockfold.select import best_span, best_spans, by_start, span_criteria, split_budget
from blockfold.stats import NormalEquations, SpanSample, SpanStatistics, SpanTable, stream_activations
from blockfold.stats.similarity import StreamMoments, StreamSimilarity
from blockfold.surgery import fold_into_down_proj, fold_through_linearized_norm, remove_blocks

#: span selection when the recipe names none: the fitted map's per-token error relative to the
#: residual stream (measured best on SmolLM2-135M, BENCHMARKS.md "Which span?")
DEFAULT_CRITERION = "fit_error_stream"
#: criteria that need the stream moments (CKA, CCA) in the pass
_MOMENT_CRITERIA = frozenset({"cka", "cca"})


@dataclass
class FittedMap:
    transform: torch.Tensor
    info: dict
    # sandwich blocks only: "linearized-norm" (T on the down-projection output, norm made linear)
    # or "through-norm" (B before the norm, fitted with the norm in the loop)
    regime: str = "exact"
    output_max_rms: float = 0.0


def closed_form_map(recipe: Recipe, equations: NormalEquations, warn: bool = True) -> tuple[torch.Tensor, dict]:
    """The recipe's estimator in closed form (lstsq for cosine, which starts from it)."""
    return fit_span_map(equations, recipe.estimator, recipe.ridge_alpha, recipe.rank, warn)


def _fit_prenorm(model, adapter, recipe, calibration, start, length, equations: NormalEquations) -> FittedMap:
    """Pre-norm blocks: T acts on the MLP contribution and folds into down_proj exactly."""
    transform, info = closed_form_map(recipe, equations)
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

    linear, linear_info = closed_form_map(recipe, z_equations)
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
    if recipe.estimator in ("diagonal", "orthogonal", "lowrank"):  # the constraint holds on T only there
        regime = "linearized-norm"
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


def _measure(model, adapter, calibration, lengths: list[int], max_length: int, moments: bool,
             description: str = "calibration pass") -> tuple[SpanTable, list[SpanTable], StreamMoments | None]:
    """One pass: distances of all spans up to ``max_length``, normal equations for every start at
    each of ``lengths``, and (``moments``) the stream moments for CKA and CCA."""
    num_layers = adapter.num_layers(model)
    fits = [SpanStatistics(num_layers, max_length=max_length if i == 0 else 0, fit_length=length)
            for i, length in enumerate(lengths)]
    observers = [*fits, *([StreamSimilarity(num_layers, lengths)] if moments else [])]
    stream_activations(model, adapter, calibration, observers, description=description)
    tables = [f.finalize() for f in fits]
    return tables[0], tables, observers[-1].finalize() if moments else None


@dataclass
class SharedMeasurement:
    """One first pass for several compressions of the same weights (a sweep over budgets)."""

    fingerprint: str
    calibration_id: int
    lengths: list[int]
    max_length: int
    measured: tuple


_SHARED: contextvars.ContextVar[SharedMeasurement | None] = contextvars.ContextVar("replaceme_shared", default=None)


@contextlib.contextmanager
def shared_first_pass(model, calibration, lengths: list[int]):
    """Within this block, ReplaceMe (and UIDL) compressions of copies of ``model`` calibrated on
    ``calibration`` with span lengths among ``lengths`` reuse one pass instead of one each. A copy
    whose weights differ (checked by fingerprint) gets its own pass as usual."""
    from blockfold.models import model_fingerprint

    adapter = get_adapter(model)
    measured = _measure(model, adapter, calibration, sorted(set(lengths), reverse=True), max(lengths), True,
                        description="shared calibration pass")
    token = _SHARED.set(SharedMeasurement(model_fingerprint(model), id(calibration), sorted(set(lengths)),
                                          max(lengths), measured))
    try:
        yield
    finally:
        _SHARED.reset(token)


def _first_pass(model, adapter, calibration, lengths: list[int], max_length: int, moments: bool,
                description: str = "calibration pass"):
    """``_measure``, or what an enclosing ``shared_first_pass`` already measured for these weights."""
    shared = _SHARED.get()
    if shared is not None and shared.calibration_id == id(calibration) and set(lengths) <= set(shared.lengths) \
            and max_length <= shared.max_length:
        from blockfold.models import model_fingerprint

        if model_fingerprint(model) == shared.fingerprint:
            distances, tables, similarity = shared.measured
            return distances, [t for t in tables if t.fit_length in lengths], similarity
    return _measure(model, adapter, calibration, lengths, max_length, moments, description)


def _refit_equations(model, adapter, calibration, start: int, length: int) -> NormalEquations:
    """Normal equations of one span on the model as it is now (a pass that stops after the span)."""
    statistics = SpanStatistics(adapter.num_layers(model), 0, length, starts=[start], stream_weighted=False)
    stream_activations(model, adapter, calibration, [statistics], description=f"refit pass (span at {start})")
    return statistics.finalize().normal_equations[start]


def _replace_span(model, adapter, recipe, calibration, start: int, length: int, equations: NormalEquations) -> dict:
    fit = _fit_prenorm if adapter.folds_exactly else _fit_sandwich
    fitted = fit(model, adapter, recipe, calibration, start, length, equations)
    _fold(model, adapter, start - 1, fitted)
    remove_blocks(model, adapter, list(range(start, start + length)))
    return fitted.info


def compress_replaceme(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, calibration: CalibrationSet
) -> dict:
    adapter = get_adapter(model)
    num_layers = adapter.num_layers(model)
    budget = recipe.num_blocks_to_remove(num_layers)
    criterion = recipe.criterion or DEFAULT_CRITERION
    if recipe.greedy:
        return _compress_greedy(model, adapter, recipe, calibration, budget, criterion)
    lengths = sorted(set(split_budget(budget, recipe.spans)), reverse=True)
    distances, fit_tables, moments = _first_pass(model, adapter, calibration, lengths, budget, criterion in _MOMENT_CRITERIA
                                              or recipe.spans == 1)
    scores = span_criteria(distances, fit_tables, moments, lambda eq: closed_form_map(recipe, eq, warn=False)[0])
    if recipe.spans == 1:
        choices = [best_span(scores[criterion], budget, criterion, fixed_start=recipe.span_start)]
    else:
        choices = best_spans(scores[criterion], split_budget(budget, recipe.spans), criterion)
    first_pass = {table.fit_length: table.normal_equations for table in fit_tables}
    replaced, removed_so_far = [], 0
    for choice in choices:  # shallowest first: a later span's map is refitted on the compressed model
        start = choice.start - removed_so_far
        if removed_so_far == 0 and choice.start in first_pass.get(choice.length, {}):
            equations = first_pass[choice.length][choice.start]
        else:
            equations = _refit_equations(model, adapter, calibration, start, choice.length)
        info = _replace_span(model, adapter, recipe, calibration, start, choice.length, equations)
        replaced.append({"blocks": choice.blocks, "folded_into_block": choice.start - 1, "score": choice.score,
                         "transform": info})
        removed_so_far += choice.length
    selection = {
        "criterion": criterion,
        "start": choices[0].start,
        "length": choices[0].length,
        "score": sum(c.score for c in choices),
        "candidates": by_start(scores[criterion], budget) if recipe.spans == 1 else choices[0].candidates,
        "scores_per_criterion": {name: values for name, values in
                                 ((name, by_start(table, budget)) for name, table in scores.items()) if values},
        "span_distances": {name: _table(getattr(distances, name)) for name in ("angular_last", "angular_all", "cosine_all")},
    }
    if recipe.spans > 1:
        selection["scores_per_length"] = {str(length): {name: by_start(values, length) for name, values in scores.items()}
                                          for length in lengths}
    manifest = {"removed_blocks": sorted(b for c in choices for b in c.blocks), "spans": replaced, "selection": selection}
    if len(replaced) == 1:  # the single-span fields every ReplaceMe manifest has had
        manifest.update(transform_folded_into_block=replaced[0]["folded_into_block"], transform=replaced[0]["transform"])
    return manifest


def _compress_greedy(model, adapter, recipe: Recipe, calibration, budget: int, criterion: str) -> dict:
    """Remove ``budget`` blocks one at a time; each round scores every block by ``criterion`` on the
    model as compressed so far, replaces the best with its fitted map, and folds it."""
    original_index = list(range(adapter.num_layers(model)))
    steps = []
    for round_number in range(budget):
        distances, fit_tables, moments = _measure(model, adapter, calibration, [1], 1, criterion in _MOMENT_CRITERIA,
                                                  description=f"greedy round {round_number + 1}/{budget}")
        scores = span_criteria(distances, fit_tables, moments, lambda eq: closed_form_map(recipe, eq, warn=False)[0])
        choice = best_span(scores[criterion], 1, criterion)
        info = _replace_span(model, adapter, recipe, calibration, choice.start, 1,
                             fit_tables[0].normal_equations[choice.start])
        steps.append({"block": original_index[choice.start], "folded_into_block": original_index[choice.start - 1],
                      "score": choice.score, "transform": info,
                      "candidates": {original_index[s]: v for s, v in choice.candidates.items()}})
        del original_index[choice.start]
    removed = sorted(step["block"] for step in steps)
    return {
        "removed_blocks": removed,
        "spans": [{"blocks": [s["block"]], "folded_into_block": s["folded_into_block"], "transform": s["transform"]}
                  for s in steps],
        "selection": {"criterion": criterion, "strategy": "greedy", "order": [s["block"] for s in steps],
                      "score": sum(s["score"] for s in steps), "candidates": steps[0]["candidates"],
                      "greedy_steps": steps},
    }


def _table(values) -> dict[str, dict[str, float]]:
    """``{length: {start: value}}`` for JSON, dropping spans that do not fit."""
    return {
        str(length): {str(start): float(values[start, length]) for start in range(values.shape[0])
                      if values[start, length] == values[start, length]}
        for length in range(1, values.shape[1])
    }
