"""Neural Block Linearization (NBL) and DROP's attention dropping: replace the attention sublayers
(or whole blocks) that a linear map predicts best by that map, or drop the ones that matter least.

Composition: one streaming pass (per-layer moments of sublayer input and contribution) → score every
layer by a linearity criterion → keep the k best → LMMSE fit ``y ≈ W x + b`` from the same moments →
replace (surgery/linearize.py). With ``greedy``, the pass is repeated after each replacement so the
next choice sees the already-linearized model (the NBL paper's greedy ablation): k passes, not one.
"""

from __future__ import annotations

from blockfold.estimate import fit_lmmse
from blockfold.methods.base import Job
from blockfold.models.handle import ModelHandle
from blockfold.select import LINEARITY_CRITERIA, lowest_scoring, score_layers
from blockfold.stats import LinearStatistics, SublayerLinearity
from blockfold.surgery import linearized_entries, replace_sublayers


def sublayer_statistics(job: Job, target: str) -> list[LinearStatistics]:
    """One calibration pass: every layer's moments of (input, contribution) of ``target``."""
    observer = SublayerLinearity(job.num_layers, target)
    job.run([observer], description=f"{target} statistics")
    return observer.finalize()


def all_scores(statistics: list[LinearStatistics]) -> dict[str, dict[int, float]]:
    """Every layer under every criterion, so a manifest lets users compare criteria after the fact."""
    return {name: dict(enumerate(score_layers(statistics, name))) for name in LINEARITY_CRITERIA}


def linearize(
    handle: ModelHandle, statistics: list[LinearStatistics], layers: list[int], target: str, ridge_alpha: float = 0.0,
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
        statistics = sublayer_statistics(job, target)
        scores = all_scores(statistics)
        step = lowest_scoring(scores[criterion], step_count, already | set(chosen))
        if replacement == "linear":
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
            "greedy": settings.greedy,
            "score": sum(chosen.values()) / len(chosen),
            "chosen_scores": chosen,
            "candidates": first_scores[criterion],
            "scores_per_criterion": first_scores,
            **({"greedy_steps": history} if settings.greedy else {}),
        },
        "fits": fits,
    }


def compress_nbl(job: Job) -> dict:
    count = job.settings.num_attention_layers(job.num_layers)
    return _compress(job, "attention", count, job.settings.linearity_criterion, "linear")


def compress_nbl_block(job: Job) -> dict:
    count = job.settings.num_blocks(job.num_layers)
    return _compress(job, "block", count, job.settings.linearity_criterion, "linear")


def compress_drop_attention(job: Job) -> dict:
    """DROP: the attention sublayers whose residual input and output are most alike (cosine), dropped."""
    count = job.settings.num_attention_layers(job.num_layers)
    return _compress(job, "attention", count, "cosine", "zero")


__all__ = ["all_scores", "compress_drop_attention", "compress_nbl", "compress_nbl_block",
           "drop_attention", "linearize", "sublayer_statistics"]
