"""Neural Block Linearization (NBL) and DROP's attention dropping: replace the attention sublayers
(or whole blocks) that a linear map predicts best by that map, or drop the ones that matter least.

Composition: one streaming pass (per-layer moments of sublayer input and contribution) → score every
layer by a linearity criterion → keep the k best → LMMSE fit ``y ≈ W x + b`` from the same moments →
replace (surgery/linearize.py). With ``greedy``, the pass is repeated after each replacement so the
next choice sees the already-linearized model (the NBL paper's greedy ablation): k passes, not one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blockfold.estimate import fit_lmmse
from blockfold.methods.base import Job
from blockfold.models.handle import ModelHandle
from blockfold.select import LINEARITY_CRITERIA, lowest_scoring, score_layers
from blockfold.stats import LinearStatistics, SublayerLinearity
from blockfold.stats.sums import layer_groups
from blockfold.surgery import linearized_entries, replace_sublayers

if TYPE_CHECKING:
    from blockfold.plan import MethodPlan, PlanContext


def measure_layers(job: Job, target: str, criterion: str) -> tuple[dict[str, dict[int, float]], dict[int, LinearStatistics]]:
    """Every layer's score under ``criterion`` (under every criterion when the moments of all layers
    fit the statistics budget: one pass) and the statistics kept for fitting.

    Beyond the budget (five d×d float64 matrices per layer: 200 GiB for Llama-3.1-70B), the cosine
    ranking needs scalars only (one pass); the others score the layers in groups that fit, one
    pass per group, and keep nothing: the chosen layers' moments are gathered again for their fit.
    """
    num_layers = job.num_layers
    per_layer = SublayerLinearity.sums_bytes_for(1, job.hidden_size)
    budget = job.runner.stats_budget()
    if per_layer * num_layers <= budget:
        # a cached pass over the same weights and calibration (a comparison of rankings) serves again
        fingerprint = job.handle.fingerprint() if job.cache is not None else None
        if fingerprint is not None:
            cached = job.cache.find("linearity", fingerprint, job.calibration, lambda what: what == {"target": target})
            if cached is not None:
                return all_scores(cached), dict(enumerate(cached))
        observer = SublayerLinearity(num_layers, target)
        job.run([observer], description=f"{target} statistics")
        statistics = observer.finalize()
        if fingerprint is not None:
            job.cache.add("linearity", fingerprint, job.calibration, {"target": target}, statistics)
        return all_scores(statistics), dict(enumerate(statistics))
    groups = layer_groups(list(range(num_layers)), per_layer, budget)
    job.notes.update(stats_budget_bytes=budget, full_sums_bytes=per_layer * num_layers, layers_per_pass=len(groups[0]))
    if criterion == "cosine":
        observer = SublayerLinearity(num_layers, target, moments=False)
        job.run([observer], description=f"{target} cosines")
        return {"cosine": {index: 1.0 - value for index, value in observer.mean_cosines().items()}}, {}
    scores: dict[str, dict[int, float]] = {name: {} for name in LINEARITY_CRITERIA}
    for group in groups:
        observer = SublayerLinearity(num_layers, target, layers=group)
        job.run([observer], description=f"{target} statistics, layers {group[0]}-{group[-1]}")
        for index, statistics in observer.measured().items():
            for name, score in LINEARITY_CRITERIA.items():
                scores[name][index] = score(statistics)
    return scores, {}


def statistics_of(job: Job, target: str, layers: list[int], kept: dict[int, LinearStatistics]) -> dict[int, LinearStatistics]:
    """The moments of ``layers``: those already ``kept``, the others from passes over groups that fit the budget."""
    missing = [layer for layer in layers if layer not in kept]
    found = {layer: kept[layer] for layer in layers if layer in kept}
    for group in layer_groups(missing, SublayerLinearity.sums_bytes_for(1, job.hidden_size), job.runner.stats_budget()):
        observer = SublayerLinearity(job.num_layers, target, layers=group)
        job.run([observer], description=f"{target} statistics of the chosen layers")
        found.update(observer.measured())
    return found


def all_scores(statistics: list[LinearStatistics]) -> dict[str, dict[int, float]]:
    """Every layer under every criterion, so a manifest lets users compare criteria after the fact."""
    return {name: dict(enumerate(score_layers(statistics, name))) for name in LINEARITY_CRITERIA}


def linearize(
    handle: ModelHandle, statistics: dict[int, LinearStatistics] | list[LinearStatistics], layers: list[int], target: str,
    ridge_alpha: float = 0.0,
) -> dict[int, dict]:
    """Replace ``layers``' attention (or whole block, ``target="block"``) by their LMMSE maps; returns fit infos."""
    adapter = handle.adapter
    maps, fits = {}, {}
    for layer in layers:
        weight, bias, info = fit_lmmse(statistics[layer], ridge_alpha)
        maps[layer] = (weight, bias)
        fits[layer] = info
    entries = [adapter.attention_replacement(layer, "linear") if target == "attention" else adapter.block_replacement(layer)
               for layer in layers]
    replace_sublayers(handle, entries, maps)
    return fits


def drop_attention(handle: ModelHandle, layers: list[int]) -> None:
    replace_sublayers(handle, [handle.adapter.attention_replacement(layer, "zero") for layer in layers])


def _compress(job: Job, target: str, count: int, criterion: str, replacement: str) -> dict:
    """Choose ``count`` layers by ``criterion`` and give them their LMMSE map (``replacement="linear"``)
    or nothing (``"zero"``, attention only)."""
    settings = job.settings
    already = {entry["layer"] for entry in linearized_entries(job.model)}
    rounds = [count] if not settings.greedy else [1] * count
    chosen: dict[int, float] = {}  # layer → its score when it was chosen
    history, fits = [], {}
    for step_count in rounds:
        scores, kept = measure_layers(job, target, criterion)
        step = lowest_scoring(scores[criterion], step_count, already | set(chosen))
        if replacement == "linear":
            statistics = statistics_of(job, target, step, kept)
            fits.update(linearize(job.handle, statistics, step, target, settings.ridge_alpha))
        else:
            drop_attention(job.handle, step)
        chosen.update({layer: scores[criterion][layer] for layer in step})
        history.append({"chosen": step, "scores": scores})
    first_scores = history[0]["scores"]
    return {
        "removed_blocks": [],
        "replaced": {"target": target, "layers": sorted(chosen), "replacement": replacement},
        "selection": {
            "criterion": criterion,
            **({"criterion_rule": "auto: nmse where attention's output is normed before the residual add, cosine "
                                  "elsewhere"} if getattr(settings, "linearity_criterion", None) == "auto" else {}),
            "greedy": settings.greedy,
            "score": sum(chosen.values()) / len(chosen),
            "chosen_scores": chosen,
            "candidates": first_scores[criterion],
            "scores_per_criterion": first_scores,
            **({"statistics": dict(job.notes)} if job.notes else {}),
            **({"greedy_steps": history} if settings.greedy else {}),
        },
        "fits": fits,
    }


def compress_nbl(job: Job) -> dict:
    count = job.settings.num_attention_layers(job.num_layers)
    return _compress(job, "attention", count, job.settings.resolved_criterion(job.adapter), "linear")


def compress_nbl_block(job: Job) -> dict:
    count = job.settings.num_blocks(job.num_layers)
    return _compress(job, "block", count, job.settings.resolved_criterion(job.adapter), "linear")


def compress_drop_attention(job: Job) -> dict:
    """DROP: the attention sublayers whose residual input and output are most alike (cosine), dropped."""
    count = job.settings.num_attention_layers(job.num_layers)
    return _compress(job, "attention", count, "cosine", "zero")


__all__ = ["all_scores", "compress_drop_attention", "compress_nbl", "compress_nbl_block",
           "drop_attention", "linearize", "measure_layers", "statistics_of"]


def plan_linearity(context: PlanContext) -> MethodPlan:
    """NBL's, NBL-block's and DROP-attention's plan for ``--dry-run``: the linearity moments of every
    layer (scored and fitted in groups where they exceed the memory budget), once or per greedy round."""
    import math

    from blockfold.plan import MethodPlan, gib
    from blockfold.settings import AttentionBudget

    settings, num_layers, d, budget = context.settings, context.num_layers, context.hidden_size, context.budget
    plan = MethodPlan()
    count = (settings.num_attention_layers(num_layers) if isinstance(settings, AttentionBudget)
             else settings.num_blocks(num_layers))
    target = settings.ranks_sublayers
    per_layer = SublayerLinearity.sums_bytes_for(1, d)
    plan.observers.append(SublayerLinearity(num_layers, target))
    criterion = settings.resolved_criterion(context.adapter) if hasattr(settings, "resolved_criterion") else "cosine"
    rounds = count if settings.greedy else 1
    if per_layer * num_layers <= budget:
        plan.sums, per_round = per_layer * num_layers, 1
        plan.stats_flops_per_token = num_layers * 10 * d * d
        plan.notes.append(f"five d x d moments for each of the {num_layers} layers ({target})")
    else:
        group = len(layer_groups(list(range(num_layers)), per_layer, budget)[0])
        fits_maps = hasattr(settings, "linearity_criterion")  # DROP removes what it ranks, with no map to fit
        fit_passes = math.ceil(count / group) if fits_maps else 0
        score_passes = 1 if criterion == "cosine" else math.ceil(num_layers / group)
        plan.sums, per_round = min(group, num_layers) * per_layer, score_passes + fit_passes
        plan.stats_flops_per_token = (num_layers * (criterion != "cosine") + count) * 10 * d * d
        plan.notes.append(f"{gib(per_layer * num_layers)} for all layers exceeds the budget: {score_passes} pass(es) "
                          f"to score the layers ({criterion}), {fit_passes} for the chosen layers' moments, "
                          f"{group} layer(s) per pass")
    plan.passes = rounds * per_round
    return plan
