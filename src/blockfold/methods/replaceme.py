"""ReplaceMe: remove the span of blocks a linear map replaces best, fold the map into the block before.

Composition: one streaming pass (span distances, and the sums the criterion and the estimator need
for every candidate start) → the criterion for every span → pick the span(s) → fit the map (closed
form from the normal equations; the cosine objective and sandwich norms take a second, truncated
pass for a token subsample) → fold into the down-projection of the block before the span → delete
the span.

Only what is asked for is accumulated: the normal equations of every candidate (two d×d float64
matrices, four with the per-token weighted ones fit_error_stream reads) when the criterion scores the fitted map, the
stream moments only for CKA and CCA. When those sums would exceed the statistics budget, the
candidates are screened first: one pass scores every start by the same criterion for the best
per-channel (diagonal) map, from d-sized sums, and a second pass accumulates the full sums for the
best K starts only, K as many as the budget holds. The manifest says which were screened.

Several spans (``spans=k``) share the budget and are chosen together from the first pass; they are
then replaced shallowest first, each later span's map refitted on the model as already compressed
(one truncated pass each). ``spans="auto"`` builds the model of each span count on a copy, fitted
without an eighth of the calibration sequences, and keeps the count with the lowest loss on those. ``greedy`` removes one block per round, the one the criterion scores best
after its own fix, with one pass per round. ``span_scoring="compare"`` builds, the same way, the span
the lstsq map scores best and the one the folded map does, where they differ, and keeps the lower loss.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from blockfold.estimate import fit_numerically, fit_span_map, linear_contribution, span_loss
from blockfold.data import Batch, CalibrationSet
from blockfold.errors import BlockfoldError
from blockfold.methods.base import Job
from blockfold.methods.refit import (DownstreamRefit, RemovedSpan, first_pass_runs_in_full, original_stream_recorder,
                                     plan_refit_sums, recording_bytes)
from blockfold.select import (SpanChoice, best_span, best_spans, by_start, span_criteria, span_label, spans_apart,
                              split_budget)
from blockfold.settings import ReplaceMe
from blockfold.stats import NormalEquations, SpanRows, SpanSample, SpanStatistics, SpanTable
from blockfold.stats.similarity import StreamMoments, StreamSimilarity
from blockfold.surgery import fold_into_mlp_output, fold_through_linearized_norm, remove_blocks

if TYPE_CHECKING:
    from blockfold.plan import MethodPlan, PlanContext

logger = logging.getLogger(__name__)

#: the share of the calibration sequences ``spans="auto"`` scores the span counts on (fitted without them)
AUTO_HELD_OUT = 1 / 8
#: criteria that score the fitted map, so every candidate needs its normal equations
_FIT_CRITERIA = frozenset({"fit_error", "fit_error_stream"})
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


@dataclass
class SpanMeasurement:
    """What the first pass measured: distances of every span up to ``max_length``, the per-start sums
    at each of ``lengths``, and the stream moments (CKA, CCA) when asked for."""

    distances: SpanTable
    tables: list[SpanTable]
    moments: StreamMoments | None
    lengths: list[int]
    max_length: int
    equations: str  # "full", "screened" or "none"
    screening: dict = field(default_factory=dict)  # length → {start: the diagonal map's score}


def closed_form_map(settings: ReplaceMe, equations: NormalEquations, warn: bool = True) -> tuple[torch.Tensor, dict]:
    """The recipe's estimator in closed form (lstsq for cosine, which starts from it)."""
    return fit_span_map(equations, settings.estimator, settings.ridge_alpha, settings.rank, warn)


def _scoring_map(settings: ReplaceMe):
    """How each candidate is scored by the fit criteria: with the least-squares map whatever is folded
    (``span_scoring: lstsq``, and first with ``compare``), or with the map that would be folded
    (``estimator``)."""
    if settings.span_scoring in ("lstsq", "compare"):
        return lambda equations: fit_span_map(equations, "lstsq", settings.ridge_alpha, warn=False)[0]
    return _own_map(settings)


def _own_map(settings: ReplaceMe):
    """The map the estimator folds, as a scoring map (None: plain removal, scored from the identity's
    scalar sums)."""
    if settings.estimator == "identity":
        return None
    return lambda equations: closed_form_map(settings, equations, warn=False)[0]


def _own_map_name(settings: ReplaceMe) -> str:
    return "the identity (plain removal)" if settings.estimator == "identity" else f"the {settings.estimator} map"


# -- the first pass ---------------------------------------------------------------------------
def measure_spans(job: Job, lengths: list[int], max_length: int, criterion: str,
                  all_criteria: bool = False, record: bool = False) -> SpanMeasurement:
    """The first pass for spans of ``lengths`` (or what a cached pass already measured).

    ``all_criteria`` accumulates what every criterion needs (the sweep's shared pass, the placement
    study); otherwise only what ``criterion`` and the estimator need, within the statistics budget.
    ``record``: a pass run here also records, in ``job.streams``, the original stream the downstream
    refit of the job's settings will read.
    """
    lengths = sorted(set(lengths), reverse=True)
    moments = all_criteria or criterion in _MOMENT_CRITERIA
    need_all = all_criteria or criterion in _FIT_CRITERIA
    weighted = all_criteria or criterion == "fit_error_stream"  # the per-token weighted sums serve it alone
    if job.cache is not None:
        fingerprint = job.handle.fingerprint()
        cached = job.cache.find("spans", fingerprint, job.calibration, lambda w: set(lengths) <= set(w["lengths"])
                                and max_length <= w["max_length"] and (w["moments"] or not moments)
                                and (w["equations"] == "full" or not need_all) and (w["weighted"] or not weighted))
        if cached is not None:
            return SpanMeasurement(cached.distances, [t for t in cached.tables if t.fit_length in lengths],
                                   cached.moments, lengths, cached.max_length, cached.equations, cached.screening)
    measured = _measure(job, lengths, max_length, moments, need_all, weighted, _screened_by(criterion), record)
    if job.cache is not None:
        job.cache.add("spans", fingerprint, job.calibration, {"lengths": lengths, "max_length": max_length,
                                                              "moments": moments, "equations": measured.equations,
                                                              "weighted": weighted},
                      measured)
    return measured


def _screened_by(criterion: str) -> str:
    """The fit criterion whose diagonal stand-in screens candidates: the chosen one, or the default's
    when a pass that measures every criterion is made for another."""
    return criterion if criterion in _FIT_CRITERIA else ReplaceMe.model_fields["criterion"].default


def _measure(job: Job, lengths: list[int], max_length: int, moments: bool, need_all: bool, weighted: bool,
             screen_by: str, record: bool = False) -> SpanMeasurement:
    num_layers, d = job.num_layers, job.hidden_size
    estimator = getattr(job.settings, "estimator", "identity")
    starts = {length: len(range(1, num_layers - length + 1)) for length in lengths}
    full_bytes = sum(SpanStatistics.sums_bytes_for(count, d, "full", weighted) for count in starts.values())
    moment_bytes = StreamSimilarity.sums_bytes_for(num_layers, len(lengths), d) if moments else 0
    budget = job.runner.stats_budget() - moment_bytes
    job.notes.update(stats_budget_bytes=job.runner.stats_budget(), full_sums_bytes=full_bytes + moment_bytes)
    if estimator == "identity" and not need_all:
        mode = "none"  # plain removal needs no map: scalars only
    elif full_bytes <= budget:
        mode = "full"
    else:
        mode = "screened" if need_all else "none"  # without a fit criterion the chosen span is refitted alone
    first_mode = {"full": "full", "none": "none", "screened": "diagonal"}[mode]
    if record:  # in what the statistics budget leaves beside the sums (screening fills it by design)
        job.streams = (original_stream_recorder(job, refit_depths(job.settings, num_layers, lengths),
                                                budget - {"full": full_bytes, "none": 0, "screened": budget}[mode])
                       if job.settings.refit != "none" else None)
    fits = [SpanStatistics(num_layers, max_length=max_length if i == 0 else 0, fit_length=length,
                           equations=first_mode, stream_weighted=weighted)
            for i, length in enumerate(lengths)]
    observers = [*fits, *([StreamSimilarity(num_layers, lengths)] if moments else [])]
    job.run(observers, description="calibration pass" if mode != "screened" else "screening pass",
            recorders=[job.streams] if job.streams is not None else [])
    tables = [f.finalize() for f in fits]
    measured = SpanMeasurement(tables[0], tables, observers[-1].finalize() if moments else None, lengths,
                               max_length, mode)
    if mode == "screened":
        _screen(job, measured, budget, screen_by, weighted)
    return measured


def refit_depths(settings: ReplaceMe, num_layers: int, lengths: list[int]) -> set[int]:
    """The depths of the original stream the downstream refit reads for any span the selection may
    choose: what the block before it reads, and what the span's last block writes."""
    depths = set()
    for length in lengths:
        starts = [settings.span_start] if settings.span_start is not None else range(1, num_layers - length + 1)
        depths.update(depth for start in starts for depth in (start - 1, start + length))
    return depths


def _screen(job: Job, measured: SpanMeasurement, budget: int, criterion: str, weighted: bool) -> None:
    """Keep the best K starts of each length by the diagonal map's score under the chosen fit
    criterion, then one more pass for their full sums; ``measured.tables`` then hold exact sums for
    those K only."""
    per_start = SpanStatistics.sums_bytes_for(1, job.hidden_size, "full", weighted)
    count = max(1, budget // (per_start * len(measured.lengths)))
    kept: dict[int, list[int]] = {}
    for table in measured.tables:
        proxy = table.diagonal_fit_error if criterion == "fit_error" else table.diagonal_fit_error_stream
        measured.screening[table.fit_length] = proxy
        kept[table.fit_length] = sorted(sorted(proxy, key=proxy.get)[:count])
    fits = [SpanStatistics(job.num_layers, 0, length, starts=kept[length], stream_weighted=weighted)
            for length in measured.lengths]
    job.run(fits, description=f"full sums for the best {count} candidates")
    exact = {f.fit_length: f.finalize() for f in fits}
    for table in measured.tables:
        table.normal_equations = exact[table.fit_length].normal_equations
        table.stream_weighted_equations = exact[table.fit_length].stream_weighted_equations
    job.notes["screening"] = {"kept_per_length": count, "by": f"the diagonal map's {criterion}",
                              "kept": {str(k): v for k, v in kept.items()}}


def refit_equations(job: Job, start: int, length: int) -> NormalEquations:
    """Normal equations of one span on the model as it is now (a pass that stops after the span)."""
    statistics = SpanStatistics(job.num_layers, 0, length, starts=[start], stream_weighted=False)
    job.run([statistics], description=f"refit pass (span at {start})")
    return statistics.finalize().normal_equations[start]


# -- fitting and folding ----------------------------------------------------------------------
def _fit_prenorm(job: Job, start: int, length: int, equations: NormalEquations) -> FittedMap:
    """Pre-norm blocks: T acts on the MLP contribution and folds into down_proj exactly."""
    settings: ReplaceMe = job.settings
    transform, info = closed_form_map(settings, equations)
    if settings.estimator == "cosine":
        sample = SpanSample(start, length, settings.cosine.max_tokens, job.calibration.num_tokens, pre_norm=False,
                            seed=job.seed)
        job.run([sample], description="sampling span rows")
        transform, info["numerical_fit"] = fit_numerically(sample.rows(), transform, settings.cosine, "cosine")
        info["relative_fit_error"] = equations.relative_residual(transform)
        info["estimator"] = "cosine"
    return FittedMap(transform, info)


def _fit_sandwich(job: Job, start: int, length: int, equations: NormalEquations) -> FittedMap:
    """Sandwich blocks: a post-MLP norm sits between down_proj and the residual (docs/gemma.md).

    Two forms fold exactly. ``linearized-norm`` fits T on the down-projection output z (closed form
    over all tokens) and makes the norm linear; ``through-norm`` folds B = diag(g) T diag(1/g) from
    the post-norm fit and refits B with the norm in the loop on a token sample. ``auto`` folds
    linearized-norm, and through-norm only where that fit is not finite: on Gemma-3-270m
    linearized-norm reached the lower perplexity at 13 of 14 starts (within 0.5 % at the other),
    including those where through-norm had the lower loss (BENCHMARKS.md, "Which sandwich fold?").
    ``compare`` fits both and keeps the lower loss on held-out calibration tokens (recipe version 3's
    auto, which compared on the fit sample).
    """
    settings: ReplaceMe = job.settings
    if settings.estimator == "identity":
        return FittedMap(*closed_form_map(settings, equations))
    fold = settings.sandwich_fold
    if settings.estimator in ("diagonal", "orthogonal", "lowrank"):  # the constraint holds on T only there
        fold = "linearized-norm"
    span = f"{start}-{start + length - 1}"
    if job.handle.dtype == torch.float16:  # the linearized fold's weights (~1e-10) and norm scale (~1e6) do not fit
        if fold in ("linearized-norm", "compare"):
            raise BlockfoldError(f"the {fold} sandwich fold needs weights near 1e-10 and a norm scale near 1e6, which "
                                 "float16 cannot hold: run in --dtype bfloat16 or float32, or use --sandwich-fold "
                                 "through-norm" + (f" (the {settings.estimator} estimator folds linearized-norm only: "
                                                   "use lstsq or cosine with it)" if fold != settings.sandwich_fold else ""))
        logger.warning("span %s: running in float16, which cannot hold the linearized-norm fold; folding through-norm",
                       span)
        fold = "through-norm"
    sample = SpanSample(start, length, settings.cosine.max_tokens, job.calibration.num_tokens, pre_norm=True,
                        seed=job.seed)
    observers = [sample]
    if fold == "compare":
        held_out = SpanSample(start, length, max(64, settings.cosine.max_tokens // 4), job.calibration.num_tokens,
                              pre_norm=True, seed=job.seed + 1, held_out_from=sample)
        observers.append(held_out)
    z_statistics = SpanStatistics(job.num_layers, 0, length, starts=[start], inputs="down_out", stream_weighted=False)
    job.run([*observers, z_statistics], description="sampling span rows")
    rows = sample.rows()
    objective = "cosine" if settings.estimator == "cosine" else "mse"

    post_norm_transform, info = fit_span_map(equations, "lstsq", settings.ridge_alpha)
    info = {"estimator": settings.estimator, "post_norm_space_relative_error": info["relative_fit_error"],
            "relative_error_plain_removal": info["relative_error_plain_removal"], "tokens": info["tokens"],
            "objective": objective}
    maps, contributions = {}, {"linearized-norm": linear_contribution}

    if fold != "through-norm":
        z_equations = z_statistics.finalize().normal_equations[start]
        linear, linear_info = closed_form_map(settings, z_equations)
        if objective == "cosine":
            linear, linear_info["numerical_fit"] = fit_numerically(rows, linear, settings.cosine, objective)
        linear_info["relative_fit_error"] = z_equations.relative_residual(linear)
        maps["linearized-norm"], info["linearized_norm"] = linear, linear_info

    def sample_losses(sample_rows: SpanRows, measure: str = objective) -> dict[str, float]:
        with torch.no_grad():
            return {name: float(span_loss(sample_rows.to(m.device), m.float(), contributions[name], measure))
                    for name, m in maps.items()}

    if fold in ("through-norm", "compare") or (fold == "auto" and not _finite(sample_losses(rows))):
        norm = job.handle.copy_of(job.adapter.mlp_norm(job.handle.layers()[start - 1]))
        scale = job.adapter.norm_scale(norm).to(post_norm_transform.device)
        contributions["through-norm"] = lambda z, b: norm(z @ b)  # B folded before the norm
        maps["through-norm"], info["through_norm"] = fit_numerically(
            rows, scale[:, None] * post_norm_transform / scale[None, :], settings.cosine, objective,
            contributions["through-norm"])
        if fold == "auto":
            logger.warning("span %s: the linearized-norm fit is not finite on the calibration sample; folding "
                           "through-norm instead", span)

    info["sample_loss_per_regime"] = losses = sample_losses(rows)
    finite = _finite(losses)
    if fold in ("linearized-norm", "through-norm") and fold not in finite:  # forced (a norm scale of 0, say)
        other = "linearized-norm" if fold == "through-norm" else "through-norm"
        raise BlockfoldError(f"the {fold} fit of span {span} is not finite on the calibration sample: "
                             f"use --sandwich-fold {other} (or auto, which falls back when its fold fails)")
    if not finite:
        raise BlockfoldError(f"no sandwich fold of span {span} has a finite loss on the calibration sample: "
                             "the block's activations are not finite; check the model's weights and dtype")
    if fold == "compare":
        held_out_rows = held_out.rows() if held_out.has_rows() else None
        if held_out_rows is None:  # the fit sample holds every calibration token: nothing is left to hold out
            logger.warning("span %s: the calibration set is no larger than the fit sample (%d tokens), so the two "
                           "sandwich folds are compared on tokens the through-norm fit has seen; calibrate on more "
                           "text for a fair comparison", span, settings.cosine.max_tokens)
            info["compared_on"] = "the fit sample (the calibration set left no token out of it)"
        else:
            info["held_out_loss_per_regime"] = losses = sample_losses(held_out_rows)
            finite = _finite(losses)
            info["compared_on"] = f"{len(held_out_rows.x)} held-out calibration tokens"
            info["held_out_cosine_distance_per_regime"] = sample_losses(held_out_rows, "cosine")
        regime = min(finite, key=finite.get)
    elif fold == "auto":
        regime = next(iter(finite))  # linearized-norm unless it was not finite
    else:
        regime = fold
    info["regime"] = regime
    if regime == "linearized-norm":
        info["relative_fit_error"] = info["linearized_norm"]["relative_fit_error"]
        linear = maps[regime]
        output_rms = float((rows.x.to(linear.device).double() @ linear).pow(2).mean(-1).sqrt().max())
        return FittedMap(linear, info, regime, output_rms)
    with torch.no_grad():  # relative squared error on the sample, whatever the objective was
        info["relative_fit_error"] = float(span_loss(rows.to(maps[regime].device), maps[regime].float(),
                                                     contributions[regime], "mse"))
    return FittedMap(maps[regime], info, regime)


def _finite(losses: dict[str, float]) -> dict[str, float]:
    return {name: loss for name, loss in losses.items() if math.isfinite(loss)}


def _fold(job: Job, block: int, fitted: FittedMap) -> None:
    layer = job.handle.layers()[block]
    if fitted.regime == "linearized-norm":
        fitted.info["linearized_norm"]["down_proj_scale"] = fold_through_linearized_norm(
            job.handle, job.adapter.down_proj(layer), job.adapter.mlp_norm(layer), fitted.transform,
            fitted.output_max_rms)
    elif fitted.info.get("estimator") != "identity":
        fold_into_mlp_output(job.handle, layer, fitted.transform)


def _replace_span(job: Job, start: int, length: int, equations: NormalEquations) -> dict:
    fit = _fit_prenorm if job.adapter.folds_exactly else _fit_sandwich
    fitted = fit(job, start, length, equations)
    _fold(job, start - 1, fitted)
    remove_blocks(job.model, job.adapter, list(range(start, start + length)))
    return fitted.info


# -- the method -------------------------------------------------------------------------------
def compress_replaceme(job: Job) -> dict:
    settings: ReplaceMe = job.settings
    # auto and compare are rules (a version 3 recipe's auto reads as compare): without a post-MLP norm
    # they have the one exact fold to choose; naming a sandwich form there is a mistake
    if settings.sandwich_fold in ("linearized-norm", "through-norm") and job.adapter.folds_exactly:
        raise BlockfoldError(f"sandwich_fold {settings.sandwich_fold} applies to blocks with a norm after the MLP "
                             f"(Gemma); {job.model.config.model_type} has none, so drop --sandwich-fold")
    if settings.spans == "auto" and job.adapter.is_vision:
        raise BlockfoldError("--spans auto compares the compressed models' next-token loss, which a vision encoder "
                             "has none of: give --spans a number (1 is the default)")
    budget = settings.num_blocks(job.num_layers)
    if settings.greedy:
        return _compress_greedy(job, budget)
    criterion = settings.criterion
    counts = settings.span_counts(budget)
    lengths = sorted({length for count in counts for length in split_budget(budget, count)}, reverse=True)
    measured = measure_spans(job, lengths, budget, criterion, record=True)
    scores = span_criteria(measured.distances, measured.tables, measured.moments, _scoring_map(settings))
    first_pass = {table.fit_length: table.normal_equations for table in measured.tables}
    shapes = {count: [best_span(scores[criterion], budget, criterion, fixed_start=settings.span_start)] if count == 1
              else best_spans(scores[criterion], split_budget(budget, count), criterion) for count in counts}
    search = _compare_span_counts(job, shapes) if len(counts) > 1 else None
    count = search["chosen"] if search is not None else counts[0]
    shortlist = _shortlist(job, scores[criterion], first_pass[budget], budget) if settings.shortlist > 1 else None
    if shortlist is not None:
        shapes[count] = [shortlist.pop("choice")]
    choices = shapes[count]
    scoring_comparison = None
    # the lstsq and cosine estimators score with the lstsq map itself: nothing to compare, no second scoring
    if (settings.span_scoring == "compare" and criterion in _FIT_CRITERIA and settings.span_start is None
            and settings.estimator not in ("lstsq", "cosine")):
        own_scores = span_criteria(measured.distances, measured.tables, measured.moments, _own_map(settings))
        own_choice = best_span(own_scores[criterion], budget, criterion)
        if own_choice.start != choices[0].start:
            scoring_comparison = _compare_span_scorings(
                job, {"the lstsq map": choices[0], _own_map_name(settings): own_choice})
            if scoring_comparison["chosen"] != "the lstsq map":
                choices, scores = [own_choice], own_scores
    replaced, refitted = _replace_spans(job, choices, first_pass)
    selection = {
        "criterion": criterion,
        "scored_with": _scored_with(settings),
        "start": choices[0].start,
        "length": choices[0].length,
        "score": sum(c.score for c in choices),
        "candidates": by_start(scores[criterion], budget) if count == 1 else choices[0].candidates,
        "scores_per_criterion": {name: values for name, values in
                                 ((name, by_start(table, budget)) for name, table in scores.items()) if values},
        "span_distances": {name: _table(getattr(measured.distances, name))
                           for name in ("angular_last", "angular_all", "cosine_all")},
        "statistics": {"sums": measured.equations, **job.notes},
    }
    if not job.adapter.folds_exactly and criterion.startswith("fit_error"):
        # sandwich blocks: the spans are ranked by the map fitted in the post-norm space; the map
        # folded into the chosen one is fitted afterwards (linearized-norm or through-norm), so the
        # score is a proxy for it (its rank agreement on Gemma-3-270m: BENCHMARKS.md, Gemma section)
        selection["scored_map"] = "post-norm lstsq (a proxy for the sandwich fold fitted after selection)"
    if measured.screening:
        selection["screening_scores"] = {str(length): values for length, values in measured.screening.items()}
    if search is not None:
        selection["span_count_search"] = search
    if scoring_comparison is not None:
        selection["span_scoring_comparison"] = scoring_comparison
    if shortlist is not None:
        selection["shortlist"] = shortlist
    if len(counts) > 1 or count > 1:
        selection["scores_per_length"] = {str(length): {name: by_start(values, length) for name, values in scores.items()}
                                          for length in lengths}
    manifest = {"removed_blocks": sorted(b for c in choices for b in c.blocks), "spans": replaced, "selection": selection}
    if refitted is not None:
        manifest["refit"] = refitted
    if len(replaced) == 1:  # the single-span fields every ReplaceMe manifest has had
        manifest.update(transform_folded_into_block=replaced[0]["folded_into_block"], transform=replaced[0]["transform"])
    return manifest


def _replace_spans(job: Job, choices: list[SpanChoice], first_pass: dict) -> tuple[list[dict], dict | None]:
    """Fold each chosen span's map and remove the span, shallowest first (a later span's map is
    refitted on the model as already compressed), then the downstream refit; returns what was
    folded per span and what the refit did."""
    settings: ReplaceMe = job.settings
    replaced, removed_so_far, refit = [], 0, None
    with contextlib.ExitStack() as stack:
        if settings.refit != "none":  # records the original streams before the surgery
            refit = stack.enter_context(DownstreamRefit.of(job, [RemovedSpan(c.start, c.length) for c in choices]))
        for choice in choices:
            start = choice.start - removed_so_far
            equations = first_pass.get(choice.length, {}).get(choice.start) if removed_so_far == 0 else None
            if equations is None or (equations.xtx is None and settings.estimator != "identity"):
                equations = refit_equations(job, start, choice.length)
            info = _replace_span(job, start, choice.length, equations)
            replaced.append({"blocks": choice.blocks, "folded_into_block": choice.start - 1, "score": choice.score,
                             "transform": info})
            removed_so_far += choice.length
        refitted = refit.apply() if refit is not None else None
    return replaced, refitted


def _shortlist(job: Job, scores, equations: dict[int, NormalEquations], length: int) -> dict:
    """``shortlist``: the criterion's best spans apart (those whose map the first pass can fit), kept by
    the held-out loss of the model with each replaced by its scoring map (``methods.shortlist``); the
    result names the kept ``choice``."""
    from blockfold.methods.shortlist import held_out_sums, shortlist_losses

    settings: ReplaceMe = job.settings
    scoring_map = _shortlist_map(settings)
    if scoring_map is not None:  # a screened pass kept full sums for its best starts only
        scores = scores.copy()
        for start in range(scores.shape[0]):
            if equations.get(start) is None or equations[start].xtx is None:
                scores[start, length] = math.nan
        if not np.isfinite(scores[:, length]).any():
            raise BlockfoldError("--shortlist fits each candidate's map from the first pass's sums, which the "
                                 "statistics budget did not hold: raise --stats-memory, or drop --shortlist")
    candidates = spans_apart(scores, length, settings.criterion, settings.shortlist)
    _, held_out = _hold_out(job.calibration, "--shortlist scores each span", "drop --shortlist")
    held = held_out_sums(job, held_out, candidates) if scoring_map is not None else {}
    maps = {c.start: None if scoring_map is None else scoring_map(equations[c.start].less(held[c.start]))
            for c in candidates}
    result = shortlist_losses(job, candidates, held_out, maps)
    for label, entry in result["candidates"].items():
        logger.info("shortlist %s: held-out calibration loss %.4f", label, entry["mean_nll"])
    result["choice"] = next(c for c in candidates if span_label(c.blocks) == result["chosen"])
    return result


def _shortlist_map(settings: ReplaceMe):
    """The map a shortlisted span is replaced by: the one that scored it (a fit criterion), else the
    one that would be folded (None: plain removal)."""
    return _scoring_map(settings) if settings.criterion in _FIT_CRITERIA else _own_map(settings)


def _compare_span_counts(job: Job, shapes: dict[int, list[SpanChoice]]) -> dict:
    """``spans="auto"``: the count whose spans' model has the lowest held-out calibration loss
    (``_compare_builds``; the fewest spans on a tie). The spans' own scores cannot compare counts
    (settings.ReplaceMe.spans), and the loss on the fitting tokens cannot either: every span brings a
    d x d map fitted to them, and at 12 of 30 blocks of SmolLM2-135M that in-sample loss preferred
    three spans to two, which held-out text ranks the other way (BENCHMARKS.md, "How many spans")."""
    return _compare_builds(job, shapes, lambda count: f"{count} span(s)")


def _compare_span_scorings(job: Job, shapes: dict[str, SpanChoice]) -> dict:
    """``span_scoring="compare"``: the span the lstsq map scores best against the one the folded map
    does, kept by held-out calibration loss (``_compare_builds``; lstsq's on a tie). Neither scoring
    holds for every estimator and model: at 8 of 30 blocks of SmolLM2-135M, under ``fit_error_stream``,
    the diagonal map's own scores picked a span 2.7 times worse than lstsq's, and at 4 of 18 blocks of
    Gemma-3-270m, under ``fit_error``, lstsq's scores picked one 20 times worse for it than its own
    (BENCHMARKS.md "Selection across estimators")."""
    return _compare_builds(job, {name: [choice] for name, choice in shapes.items()}, lambda name: f"span scored by {name}")


def _compare_builds(job: Job, shapes: dict, describe: Callable[[object], str]) -> dict:
    """For each candidate (its spans), fit the maps and refit on a copy of the model without the
    held-out calibration sequences, measure the copy's next-token loss on those, and choose the
    candidate with the lowest, the first given on a tie (candidates that remove the same blocks are
    one model, built once)."""
    from blockfold.eval.perplexity import summed_nll
    from blockfold.pipelines import Runner

    fitting, held_out = _hold_out(job.calibration)
    # the copies run without the job's checkpoints and statistics cache: theirs are the job's passes
    execution = job.runner.execution.model_copy(update={"resume_dir": None, "stats_cache": None})
    built: dict[tuple[int, ...], dict] = {}
    candidates = {}
    for key, choices in shapes.items():
        blocks = tuple(b for c in choices for b in c.blocks)
        if blocks not in built:
            twin = job.handle.fresh_copy()
            twin_job = Job(twin, job.settings, fitting, Runner(twin, execution), None, job.seed)
            _replace_spans(twin_job, choices, {})
            total, tokens = summed_nll(twin, held_out, f"held-out loss, {describe(key)}")
            built[blocks] = {"mean_nll": total / tokens, "passes": twin_job.runner.passes + 1}
            del twin, twin_job
        candidates[key] = {"removed_blocks": list(blocks), "spans": [span_label(c.blocks) for c in choices],
                           **built[blocks]}
        logger.info("%s %s: held-out calibration loss %.4f", describe(key), candidates[key]["spans"],
                    candidates[key]["mean_nll"])
    chosen = min(candidates, key=lambda key: candidates[key]["mean_nll"])  # min keeps the first on a tie
    return {"measure": "mean next-token loss on held-out calibration sequences, the maps fitted without them",
            "held_out_sequences": sum(len(batch) for batch in held_out),
            "held_out_tokens": sum(batch.num_tokens for batch in held_out),
            "candidates": candidates, "chosen": chosen,
            "candidate_passes": sum(entry["passes"] for entry in built.values())}


def _hold_out(calibration: CalibrationSet, purpose: str = "--spans auto scores each span count",
              instead: str = "give --spans a number") -> tuple[CalibrationSet, list[Batch]]:
    """The calibration set without its last eighth of sequences (at least one), and those sequences:
    whole batches where there are several, else rows of the one batch."""
    batches = list(calibration.batches)
    if len(batches) == 1:
        batch = batches[0]
        if len(batch) < 2:
            raise BlockfoldError(f"{purpose} on calibration sequences its maps were not fitted on, and one "
                                 f"sequence leaves none: calibrate on more (--num-seqs), or {instead}")
        held = max(1, round(len(batch) * AUTO_HELD_OUT))
        batches = [Batch(batch.input_ids[:-held], batch.attention_mask[:-held]),
                   Batch(batch.input_ids[-held:], batch.attention_mask[-held:])]
        held = 1
    else:
        held = max(1, round(len(batches) * AUTO_HELD_OUT))
    fitting = CalibrationSet(batches[:-held], {**calibration.description, "held_out_for_span_count": True})
    return fitting, batches[-held:]


def _compress_greedy(job: Job, budget: int) -> dict:
    """Remove ``budget`` blocks one at a time; each round scores every block by the criterion on the
    model as compressed so far, replaces the best with its fitted map, and folds it."""
    settings: ReplaceMe = job.settings
    criterion = settings.criterion
    original_index = list(range(job.num_layers))
    steps = []
    for round_number in range(budget):
        measured = _measure(job, [1], 1, criterion in _MOMENT_CRITERIA, criterion in _FIT_CRITERIA,
                            criterion == "fit_error_stream", _screened_by(criterion))
        scores = span_criteria(measured.distances, measured.tables, measured.moments, _scoring_map(settings))
        choice = best_span(scores[criterion], 1, criterion)
        equations = measured.tables[0].normal_equations.get(choice.start)
        if equations is None or (equations.xtx is None and settings.estimator != "identity"):
            equations = refit_equations(job, choice.start, 1)
        info = _replace_span(job, choice.start, 1, equations)
        steps.append({"block": original_index[choice.start], "folded_into_block": original_index[choice.start - 1],
                      "score": choice.score, "transform": info,
                      "candidates": {original_index[s]: v for s, v in choice.candidates.items()}})
        del original_index[choice.start]
    removed = sorted(step["block"] for step in steps)
    return {
        "removed_blocks": removed,
        "spans": [{"blocks": [s["block"]], "folded_into_block": s["folded_into_block"], "transform": s["transform"]}
                  for s in steps],
        "selection": {"criterion": criterion, "scored_with": _scored_with(settings), "strategy": "greedy", "order": [s["block"] for s in steps],
                      "score": sum(s["score"] for s in steps), "candidates": steps[0]["candidates"],
                      "greedy_steps": steps, "statistics": dict(job.notes)},
    }


def _scored_with(settings: ReplaceMe) -> str:
    """What the fit criteria scored each candidate with (the other criteria read the stream alone)."""
    if settings.span_scoring == "lstsq":
        return "the lstsq map"
    if settings.span_scoring == "compare":
        return f"the lstsq map and {_own_map_name(settings)}, kept by held-out calibration loss where they differ"
    return _own_map_name(settings)


def _table(values) -> dict[str, dict[str, float]]:
    """``{length: {start: value}}`` for JSON, dropping spans that do not fit."""
    return {
        str(length): {str(start): float(values[start, length]) for start in range(values.shape[0])
                      if not math.isnan(values[start, length])}
        for length in range(1, values.shape[1])
    }


__all__ = ["SpanMeasurement", "closed_form_map", "compress_replaceme", "measure_spans", "refit_equations"]


def plan_span_removal(context: PlanContext) -> MethodPlan:
    """ReplaceMe's (and UIDL's) plan for ``--dry-run``: the span statistics its criterion needs (screened
    in two passes where they exceed the memory budget), the fits, the models it builds and its refit."""
    from blockfold.plan import MethodPlan, gib
    from blockfold.select import split_budget
    from blockfold.stats import SpanStatistics
    from blockfold.stats.similarity import StreamSimilarity

    settings, num_layers, d, budget = context.settings, context.num_layers, context.hidden_size, context.budget
    plan = MethodPlan()
    n = settings.num_blocks(num_layers)
    counts = settings.span_counts(n)
    lengths = sorted({length for count in counts for length in split_budget(n, count)})
    criterion = settings.criterion
    need_all = criterion in ("fit_error", "fit_error_stream")
    weighted = criterion == "fit_error_stream"  # the per-token weighted sums serve it alone
    estimator = getattr(settings, "estimator", "identity")
    starts = {length: num_layers - length for length in lengths}
    full = sum(SpanStatistics.sums_bytes_for(count, d, "full", weighted) for count in starts.values())
    moments = StreamSimilarity.sums_bytes_for(num_layers, len(lengths), d) if criterion in ("cka", "cca") else 0
    plan.observers.append(SpanStatistics(num_layers, n, max(lengths)))
    screened = False
    if estimator == "identity" and not need_all:
        plan.sums, mode = moments, "no normal equations (plain removal: scalars only)"
    elif full + moments <= budget:
        plan.sums, mode = full + moments, f"full normal equations for all {sum(starts.values())} candidates"
        plan.stats_flops_per_token = sum(starts.values()) * (8 if weighted else 4) * d * d
    elif need_all:
        screened = True
        per_start = SpanStatistics.sums_bytes_for(1, d, "full", weighted)
        keep = max(1, (budget - moments) // (per_start * len(lengths)))
        plan.sums = keep * per_start * len(lengths) + moments
        plan.passes += 1
        plan.stats_flops_per_token = keep * len(lengths) * (8 if weighted else 4) * d * d
        mode = (f"{gib(full)} for all candidates exceeds the budget: pass 1 screens every start with d-sized sums, "
                f"pass 2 accumulates full sums for the best {keep} per length")
    else:
        plan.sums, mode = moments, "distances only; the chosen span's sums in a refit pass"
        plan.passes += 1
    plan.notes.append(mode)
    # a numerical fit (cosine, or a fold past a post-MLP norm) samples its tokens in a pass per span folded
    sample = int(isinstance(settings, ReplaceMe) and (settings.estimator == "cosine" or not context.adapter.folds_exactly))
    if getattr(settings, "greedy", False):
        plan.passes = n * (1 + sample)  # per round: the statistics, and the sample
    # later spans are refitted on the compressed model; a refit reads the original streams (recorded in
    # the first pass for the model it builds in place; a candidate on a copy records them in a pass of its
    # own), then runs both streams through the later blocks
    refit = 2 if settings.refit != "none" else 0
    build = {count: count - 1 + refit + (count * sample if not getattr(settings, "greedy", False) else 0)
             for count in counts}
    recorded = 0
    if refit and not getattr(settings, "greedy", False):
        depths = refit_depths(settings, num_layers, lengths)
        needed = recording_bytes(len(depths), context.tokens, d, context.element)
        room = context.budget - (context.budget if screened else plan.sums)  # screening fills the budget
        plan.recorded = needed if needed <= room else 0
        # a first pass served by the statistics cache or resumed records nothing: the refit's own pass then
        recorded = int(needed <= room and first_pass_runs_in_full(context.execution))
        plan.notes.append(f"refit: the original stream at {len(depths)} depths ({gib(needed)}) " + (
            "recorded in the first pass, so the refit runs no pass of its own to read it" if recorded else
            f"exceeds the {gib(max(room, 0))} the budget leaves: the refit reads it in a pass of its own"
            if not plan.recorded else "recorded in the first pass where it runs in full; a pass of its own is "
            "counted, as a statistics cache or a resume may serve that pass"))
    plan.passes += (build[counts[0]] if len(counts) == 1 else sum(b + 1 for b in build.values()) + max(build.values())) \
        - recorded
    if refit:
        plan_refit_sums(context, plan)
    if getattr(settings, "shortlist", 1) > 1:
        # the held-out sums (a pass over an eighth of the sequences, where there is a map to fit) and one
        # sweep of those carrying a stream per candidate from its span's end on (about half the blocks)
        with_map = int(_shortlist_map(settings) is not None)
        plan.passes += with_map + 1
        plan.extra_forward += AUTO_HELD_OUT * (with_map + 1 + settings.shortlist / 2) - with_map - 1
        plan.notes.append(f"shortlist: the best {settings.shortlist} spans apart, each kept or not by the held-out "
                          f"loss of the model with its map, on {AUTO_HELD_OUT:.0%} of the sequences")
    if len(counts) > 1:
        plan.weight_copies = 2  # the original beside one candidate's copy
        plan.notes.append(f"spans auto: the model built with {', '.join(map(str, counts))} spans on a copy (another "
                          f"{'copy of the weights' if context.pipeline == 'whole' else 'skeleton over the checkpoint'}), "
                          "each fitted without an eighth of the calibration and scored with one pass of its loss on "
                          "it, then the chosen count's model built again in place (counted at most: touching spans "
                          "build one model once)")
    return plan
