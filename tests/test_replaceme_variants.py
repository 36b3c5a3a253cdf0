"""ReplaceMe variants: constrained estimators, span criteria, several spans, greedy selection."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import handle_of, random_calibration, silence_blocks, stream, tiny_model, tiny_tokenizer

import blockfold
from blockfold.adapters import get_adapter
from blockfold.errors import BlockfoldError
from blockfold.estimate import fit_diagonal, fit_lowrank, fit_lstsq, fit_orthogonal, fit_span_map
from blockfold.recipe import Recipe
from blockfold.select import best_spans, linear_cka, split_budget
from blockfold.select.linearity import canonical_correlations
from blockfold.stats import LinearStatistics, NormalEquations
from blockfold.stats.similarity import StreamSimilarity


def _equations(x: torch.Tensor, y: torch.Tensor) -> NormalEquations:
    return NormalEquations(x.T @ x, x.T @ y, float((y * y).sum()), float(((x - y) ** 2).sum()), x.shape[0])


def _data(transform: torch.Tensor, noise: float = 0.0, tokens: int = 4000, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    d = transform.shape[0]
    x = torch.randn(tokens, d, generator=generator, dtype=torch.float64) * torch.linspace(0.5, 3, d, dtype=torch.float64)
    return x, x @ transform + noise * torch.randn(tokens, d, generator=generator, dtype=torch.float64)


D = 24


def test_diagonal_recovers_a_diagonal_transform():
    truth = torch.diag(torch.linspace(-2, 2, D, dtype=torch.float64))
    transform, info = fit_diagonal(_equations(*_data(truth)))
    assert torch.allclose(transform, truth, atol=1e-10)
    # an exact fit: the error, computed from the sums, cancels to float64 rounding (whose size depends on
    # the summation order, hence on the thread count: 2e-16 on one thread), far below any inexact fit's
    assert info["relative_fit_error"] < 1e-12 and info["parameters_fitted"] == D


def test_diagonal_is_the_best_diagonal_under_noise():
    """With noise and correlated inputs the closed form still minimises the error over diagonals."""
    truth = torch.diag(torch.linspace(0.5, 1.5, D, dtype=torch.float64)) + 0.05 * torch.randn(D, D, dtype=torch.float64)
    equations = _equations(*_data(truth, noise=0.3))
    transform, info = fit_diagonal(equations)
    for _ in range(20):
        nudged = transform + torch.diag(0.01 * torch.randn(D, dtype=torch.float64))
        assert equations.relative_residual(nudged) >= info["relative_fit_error"]


def test_orthogonal_recovers_a_rotation():
    truth, _ = torch.linalg.qr(torch.randn(D, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
    transform, info = fit_orthogonal(_equations(*_data(truth, noise=0.01)))
    assert torch.allclose(transform @ transform.T, torch.eye(D, dtype=torch.float64), atol=1e-10)
    assert (transform - truth).abs().max() < 1e-2
    assert info["relative_fit_error"] < 1e-3


def test_lowrank_recovers_identity_plus_low_rank():
    generator = torch.Generator().manual_seed(4)
    u, v = torch.randn(D, 3, generator=generator, dtype=torch.float64), torch.randn(3, D, generator=generator, dtype=torch.float64)
    truth = torch.eye(D, dtype=torch.float64) + u @ v / 3
    equations = _equations(*_data(truth))
    transform, info = fit_lowrank(equations, rank=3)
    assert torch.allclose(transform, truth, atol=1e-8)
    assert torch.linalg.matrix_rank(transform - torch.eye(D, dtype=torch.float64)) == 3
    # a rank-1 correction cannot fit it, but does better than the identity, and no better than lstsq
    _, rank_one = fit_lowrank(equations, rank=1)
    assert fit_lstsq(equations)[1]["relative_fit_error"] < rank_one["relative_fit_error"] < equations.relative_error_identity()


def test_lowrank_with_full_rank_is_lstsq():
    truth = torch.randn(D, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    equations = _equations(*_data(truth, noise=0.5))
    assert torch.allclose(fit_lowrank(equations, rank=D)[0], fit_lstsq(equations)[0], atol=1e-8)


def test_unknown_estimator_and_missing_rank_are_named():
    equations = _equations(*_data(torch.eye(D, dtype=torch.float64)))
    with pytest.raises(BlockfoldError, match="--rank"):
        fit_span_map(equations, "lowrank")
    with pytest.raises(BlockfoldError, match="unknown estimator"):
        fit_span_map(equations, "magic")


def test_linear_cka_and_cca_of_related_streams():
    x, y = _data(torch.randn(D, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6)))
    same = _moments(x, x)
    assert linear_cka(same) == pytest.approx(1.0)
    assert torch.allclose(canonical_correlations(_moments(x, y)), torch.ones(D, dtype=torch.float64), atol=1e-8)
    unrelated = _moments(x, torch.randn_like(x))
    assert linear_cka(unrelated) < 0.05
    assert float(canonical_correlations(unrelated).max()) < 0.2


def _moments(x: torch.Tensor, y: torch.Tensor) -> LinearStatistics:
    mx, my = x.mean(0), y.mean(0)
    xc, yc = x - mx, y - my
    n = x.shape[0]
    return LinearStatistics(mx, my, xc.T @ xc / n, yc.T @ yc / n, yc.T @ xc / n, n, math.nan, {})


def test_stream_similarity_matches_direct_moments(tokenizer):
    """Streamed, sharded moments of (h[s], h[s+2]) equal those computed from the full hidden states."""
    model = tiny_model("llama")
    calibration = random_calibration()
    shards = [StreamSimilarity(6, [2]), StreamSimilarity(6, [2])]
    for shard, batch in zip(shards, calibration.batches):
        stream(model, [batch], [shard])
    moments = shards[0].merge(shards[1]).finalize()
    ids = torch.cat([b.input_ids for b in calibration.batches])
    with torch.no_grad():
        hidden = model.model(ids, output_hidden_states=True).hidden_states
    # hidden_states[k] enters block k, except the last, which is after the final norm
    x, y = hidden[1].reshape(-1, 32).double(), hidden[3].reshape(-1, 32).double()
    direct = _moments(x, y)
    pair = moments.pair(1, 2)
    assert torch.allclose(pair.cov_yx, direct.cov_yx, atol=1e-8 * float(direct.cov_yx.abs().max()))
    assert torch.allclose(pair.cov_xx, direct.cov_xx, atol=1e-8 * float(direct.cov_xx.abs().max()))


def test_split_budget_and_best_spans_merge_touching_spans():
    assert split_budget(8, 2) == [4, 4] and split_budget(8, 3) == [3, 3, 2]
    scores = np.full((11, 4), 5.0)
    scores[0] = np.nan
    scores[2, 2], scores[7, 1] = 0.1, 0.2  # the best pair: 2-3 and 7
    assert [(c.start, c.length) for c in best_spans(scores, [2, 1], "x")] == [(2, 2), (7, 1)]
    scores[4, 1] = 0.0  # now 2-3 and 4 are best: they touch and become one span
    assert [(c.start, c.length) for c in best_spans(scores, [2, 1], "x")] == [(2, 3)]
    with pytest.raises(BlockfoldError, match="do not fit"):
        best_spans(np.full((4, 4), np.nan), [1, 1], "x")


@pytest.mark.parametrize("criterion", ["fit_error", "fit_error_stream", "angular_last", "cka"])
def test_greedy_removes_scattered_do_nothing_blocks(tokenizer, criterion):
    """Blocks 1 and 4 pass their input through: one contiguous span cannot take both, greedy does,
    with a fitted map that is the identity, so the logits do not move."""
    model = tiny_model("llama")
    silence_blocks(model, [1, 4])
    ids = torch.randint(4, 96, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits
    result = blockfold.compress(model, tokenizer, {"blocks": 2, "greedy": True, "criterion": criterion},
                                calibration=random_calibration(num_sequences=16))
    manifest = result.manifest
    assert manifest["removed_blocks"] == [1, 4]
    assert sorted(manifest["selection"]["order"]) == [1, 4] and len(manifest["spans"]) == 2
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max() < 1e-3


def test_greedy_order_follows_the_criterion_after_each_removal(tokenizer):
    """The first round's candidates are every removable block; the chosen one scores lowest."""
    model = tiny_model("llama")
    silence_blocks(model, [3])
    result = blockfold.compress(model, tokenizer, {"blocks": 2, "greedy": True}, calibration=random_calibration())
    steps = result.manifest["selection"]["greedy_steps"]
    assert steps[0]["block"] == 3 and steps[0]["score"] == min(steps[0]["candidates"].values())
    assert set(steps[0]["candidates"]) == {1, 2, 3, 4, 5} and 3 not in steps[1]["candidates"]


def test_two_spans_each_get_a_transform(tokenizer):
    model = tiny_model("llama")
    silence_blocks(model, [1, 3, 4])
    ids = torch.randint(4, 96, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits
    result = blockfold.compress(model, tokenizer, {"blocks": 3, "spans": 2}, calibration=random_calibration(num_sequences=16))
    manifest = result.manifest
    assert manifest["removed_blocks"] == [1, 3, 4]
    assert [span["blocks"] for span in manifest["spans"]] == [[1], [3, 4]]
    assert [span["folded_into_block"] for span in manifest["spans"]] == [0, 2]
    assert "transform" not in manifest  # one per span instead
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max() < 1e-3


def test_touching_spans_become_one_transform(tokenizer):
    model = tiny_model("llama")
    silence_blocks(model, [2, 3])
    result = blockfold.compress(model, tokenizer, {"blocks": 2, "spans": 2}, calibration=random_calibration(num_sequences=16))
    assert [span["blocks"] for span in result.manifest["spans"]] == [[2, 3]]
    assert result.manifest["transform_folded_into_block"] == 1


@pytest.mark.parametrize("estimator", ["diagonal", "orthogonal", "lowrank"])
def test_constrained_estimators_fold_their_constrained_map(tokenizer, estimator):
    """The folded down-projection equals Tᵀ·W_down for a T in the estimator's family."""
    model = tiny_model("llama")
    adapter = get_adapter(model)
    recipe = {"blocks": 2, "estimator": estimator, "span_start": 2, **({"rank": 4} if estimator == "lowrank" else {})}
    before = adapter.down_proj(adapter.layers(model)[1]).weight.detach().double().clone()
    result = blockfold.compress(model, tokenizer, recipe, calibration=random_calibration())
    after = adapter.down_proj(adapter.layers(model)[1]).weight.detach().double()
    transform = torch.linalg.lstsq(before.T, after.T).solution  # after = Tᵀ before  ⇔  afterᵀ = beforeᵀ T
    identity = torch.eye(32, dtype=torch.float64)
    if estimator == "diagonal":
        assert (transform - torch.diag(transform.diagonal())).abs().max() < 1e-4
    elif estimator == "orthogonal":
        assert (transform @ transform.T - identity).abs().max() < 1e-4
    else:
        assert torch.linalg.matrix_rank(transform - identity, atol=1e-4) == 4
    fit = result.manifest["transform"]
    assert fit["estimator"] == estimator
    assert fit["relative_fit_error"] >= blockfold.compress(
        tiny_model("llama"), tokenizer, {"blocks": 2, "span_start": 2}, calibration=random_calibration()
    ).manifest["transform"]["relative_fit_error"] - 1e-9, "no constrained map beats unconstrained least squares"


def test_cosine_l1_penalty_shrinks_the_transform(tokenizer):
    sums = []
    for penalty in (0.0, 0.05):
        model = tiny_model("llama")
        adapter = get_adapter(model)
        recipe = {"blocks": 2, "span_start": 2, "estimator": "cosine", "cosine": {"l1_penalty": penalty, "steps": 30}}
        before = adapter.down_proj(adapter.layers(model)[1]).weight.detach().double().clone()
        result = blockfold.compress(model, tokenizer, recipe, calibration=random_calibration())
        after = adapter.down_proj(adapter.layers(model)[1]).weight.detach().double()
        sums.append(float(torch.linalg.lstsq(before.T, after.T).solution.abs().sum()))
        assert result.manifest["transform"]["numerical_fit"]["l1_penalty"] == penalty
    assert sums[1] < sums[0]


def test_every_criterion_the_pass_measured_is_recorded_for_every_candidate(tokenizer):
    """Only what the criterion needs is accumulated: the default pass has the distances and the fitted
    maps' errors, not the per-token weighted sums behind fit_error_stream (half the sums' memory),
    which a fit_error_stream run adds, nor the stream moments behind CKA and CCA, which a CKA run adds."""
    result = blockfold.compress(tiny_model("llama"), tokenizer, {"blocks": 2}, calibration=random_calibration())
    selection = result.manifest["selection"]
    assert selection["criterion"] == "fit_error"
    scores = selection["scores_per_criterion"]
    assert set(scores) == {"angular_last", "angular_all", "block_influence", "fit_error"}
    assert all(set(values) == {1, 2, 3, 4} for values in scores.values())
    assert selection["start"] == min(scores["fit_error"], key=scores["fit_error"].get)
    assert selection["statistics"]["sums"] == "full"
    stream = blockfold.compress(tiny_model("llama"), tokenizer, {"blocks": 2, "criterion": "fit_error_stream"},
                                calibration=random_calibration()).manifest["selection"]
    assert set(stream["scores_per_criterion"]) == {*scores, "fit_error_stream"}
    assert stream["scores_per_criterion"]["fit_error"] == scores["fit_error"]
    assert selection["statistics"]["full_sums_bytes"] * 2 == stream["statistics"]["full_sums_bytes"]
    cka = blockfold.compress(tiny_model("llama"), tokenizer, {"blocks": 2, "criterion": "cka"},
                             calibration=random_calibration()).manifest["selection"]["scores_per_criterion"]
    assert {"cka", "cca"} <= set(cka) and all(set(cka[name]) == {1, 2, 3, 4} for name in ("cka", "cca"))


def test_uidl_still_selects_by_angular_distance(tokenizer):
    result = blockfold.compress(tiny_model("llama"), tokenizer, {"method": "uidl", "blocks": 2}, calibration=random_calibration())
    assert result.manifest["selection"]["criterion"] == "angular_last"


@pytest.mark.parametrize("recipe, message", [
    ({"estimator": "lstsq", "rank": 4}, "lowrank estimator only"),
    ({"spans": 2, "greedy": True}, "cannot be combined"),
    ({"spans": 2, "span_start": 3}, "cannot be combined"),
    ({"method": "nbl", "spans": 2}, "spans does not apply to method 'nbl'"),
    ({"method": "nbl", "estimator": "lstsq"}, "estimator does not apply to method 'nbl'"),
    ({"linearity_criterion": "cca"}, "linearity_criterion does not apply to method 'replaceme'"),
    ({"estimator": "diagonal", "sandwich_fold": "through-norm"}, "constraint would not hold"),
    ({"estimator": "identity", "sandwich_fold": "linearized-norm"}, "folds none"),
    ({"calibration": {"source": "a.jsonl:0.5,b.jsonl"}}, "every part a weight"),
    ({"calibration": {"source": "a.jsonl:0,b.jsonl:1"}}, "positive"),
])
def test_recipe_rejects_inconsistent_variants(recipe, message):
    with pytest.raises(BlockfoldError, match=message):
        Recipe.parse(recipe)


def test_a_sandwich_fold_is_refused_on_blocks_without_a_post_mlp_norm(tokenizer):
    with pytest.raises(BlockfoldError, match="llama has none"):
        blockfold.compress(tiny_model("llama"), tokenizer, {"blocks": 1, "sandwich_fold": "through-norm"},
                           calibration=random_calibration())


def test_lowrank_defaults_to_rank_32_and_spans_must_fit_the_budget():
    assert Recipe.parse({"estimator": "lowrank"}).settings.rank == 32
    with pytest.raises(BlockfoldError, match="--spans at most 2"):
        Recipe.parse({"blocks": 2, "spans": 3}).settings.num_blocks(6)


def test_a_shared_first_pass_gives_the_same_compressions(tokenizer):
    """A sweep's one pass for several budgets, handed to each compression as an argument: the same
    removed blocks and the same folded weights as one pass per compression, and no pass of their own;
    a copy with other weights is not served the shared statistics."""
    import copy

    from blockfold.methods import PassCache
    from blockfold.runtime import Execution
    from blockfold.sweep import _shared_span_pass

    base, calibration = tiny_model("llama"), random_calibration(num_sequences=16)
    separate = {}
    for method, blocks in (("replaceme", 1), ("replaceme", 2), ("uidl", 2)):
        model = copy.deepcopy(base)
        manifest = blockfold.compress(model, tokenizer, {"method": method, "blocks": blocks}, calibration=calibration).manifest
        separate[(method, blocks)] = (manifest["removed_blocks"], model.state_dict())
    cache = PassCache()
    _shared_span_pass(handle_of(base, tokenizer), calibration, [1, 2], Execution(), cache)
    for (method, blocks), (removed, weights) in separate.items():
        model = copy.deepcopy(base)
        manifest = blockfold.compress(model, tokenizer, {"method": method, "blocks": blocks}, calibration=calibration,
                                      cache=cache).manifest
        # the selection's pass is shared; the default refit's two passes run on each model's own streams
        assert manifest["removed_blocks"] == removed and manifest["execution"]["passes"] == (2 if method == "replaceme" else 0)
        assert all(torch.allclose(weights[k], v, atol=1e-6) for k, v in model.state_dict().items())
    other = tiny_model("llama", seed=3)
    expected = blockfold.compress(copy.deepcopy(other), tokenizer, {"blocks": 2}, calibration=calibration).manifest
    got = blockfold.compress(copy.deepcopy(other), tokenizer, {"blocks": 2}, calibration=calibration, cache=cache).manifest
    assert got["execution"]["passes"] == 1 + 1  # its own first pass, which records what the refit reads; the refit
    assert got["selection"]["candidates"] == expected["selection"]["candidates"]


def _rows(tokens: int = 256, d: int = 8, seed: int = 0):
    from blockfold.stats import SpanRows

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=generator)
    attn = torch.randn(tokens, d, generator=generator)
    return SpanRows(x, attn, attn + x @ torch.randn(d, d, generator=generator))


def test_a_numerical_fit_whose_line_search_overflows_keeps_its_best_point_instead_of_crashing(monkeypatch):
    """Gemma-3-270m, span 1-4, through-norm: L-BFGS's strong-Wolfe step overflowed float32 and compress
    ended in a RuntimeError traceback. The fit now keeps the best point it evaluated and says so."""
    from blockfold.estimate.numeric import fit_numerically
    from blockfold.settings import CosineConfig

    rows, init = _rows(), torch.eye(8)
    real_step = torch.optim.LBFGS.step

    def overflowing_step(self, closure):
        real_step(self, closure)  # two honest iterations, then the overflow
        raise RuntimeError("value cannot be converted to type float without overflow")

    monkeypatch.setattr(torch.optim.LBFGS, "step", overflowing_step)
    transform, info = fit_numerically(rows, init, CosineConfig(steps=2), "mse")
    assert torch.isfinite(transform).all()
    assert "overflow" in info["diverged"]
    assert info["loss_end"] <= info["loss_start"]


def test_a_numerical_fit_that_turns_non_finite_returns_the_best_finite_map():
    from blockfold.estimate.numeric import fit_numerically
    from blockfold.settings import CosineConfig

    rows, init = _rows(), torch.eye(8)
    calls = {"n": 0}

    def breaks_after_a_while(x, transform):
        calls["n"] += 1
        out = x @ transform
        return out if calls["n"] < 6 else out * float("nan")

    transform, info = fit_numerically(rows, init, CosineConfig(steps=20), "mse", breaks_after_a_while)
    assert torch.isfinite(transform).all() and info["diverged"]
    _, healthy = fit_numerically(rows, init, CosineConfig(steps=20), "mse")
    assert "diverged" not in healthy


@pytest.mark.parametrize("estimator", ["diagonal", "orthogonal", "identity"])
def test_spans_are_scored_with_the_lstsq_map_whatever_the_estimator_folds(tokenizer, estimator):
    """``span_scoring: lstsq`` (recipe versions 7-11): every estimator's candidates get the lstsq map's
    fit errors (the scores the lstsq estimator sees); ``estimator`` (version 6) scores with the folded map."""
    calibration = random_calibration()

    def candidates(**settings):
        result = blockfold.compress(tiny_model("llama"), tokenizer, {"blocks": 2, "criterion": "fit_error", **settings},
                                    calibration=calibration)
        return result.manifest["selection"]

    reference = candidates(estimator="lstsq")["candidates"]
    scored = candidates(estimator=estimator, span_scoring="lstsq")
    assert scored["scored_with"] == "the lstsq map"
    assert scored["candidates"] == pytest.approx(reference, rel=1e-9)
    own = candidates(estimator=estimator, span_scoring="estimator")
    assert own["scored_with"] != "the lstsq map"
    assert own["candidates"] != pytest.approx(reference, rel=1e-3)


def test_old_recipes_keep_their_span_scoring_and_version_12_compares_one_span():
    migrated = Recipe.parse({"recipe_version": 6, "settings": {"blocks": 3, "estimator": "diagonal"}})
    assert migrated.settings.span_scoring == "estimator"
    assert Recipe.parse({"recipe_version": 6, "method": "uidl", "settings": {"blocks": 3}}).settings.span_scoring == "estimator"
    assert Recipe.parse({"recipe_version": 11, "settings": {"blocks": 3, "estimator": "diagonal"}}).settings.span_scoring == "lstsq"
    # version 12: one span compares both scorings; several spans and greedy score with lstsq
    assert Recipe.parse({"blocks": 3, "estimator": "diagonal"}).settings.span_scoring == "compare"
    assert Recipe.parse({"blocks": 3, "spans": 2}).settings.span_scoring == "lstsq"
    assert Recipe.parse({"blocks": 3, "greedy": True}).settings.span_scoring == "lstsq"


@pytest.mark.parametrize("blocks", [1, 2])
def test_span_scoring_compare_builds_both_spans_and_keeps_the_lower_held_out_loss(tokenizer, blocks):
    """Where the lstsq map and the folded (diagonal) map score different spans best, both are built
    without the held-out calibration sequences and the one with the lower loss on them is compressed
    in place, on every sequence: the model ``span_start`` at its start builds. (On this seed the
    diagonal map's span wins at one block and lstsq's at two, so both outcomes run.)"""
    calibration = random_calibration(num_sequences=16)
    model = tiny_model("llama")
    settings = {"blocks": blocks, "estimator": "diagonal", "criterion": "fit_error"}
    result = blockfold.compress(model, tokenizer, {**settings, "span_scoring": "compare"}, calibration=calibration)
    selection = result.manifest["selection"]
    comparison = selection["span_scoring_comparison"]
    losses = {name: entry["mean_nll"] for name, entry in comparison["candidates"].items()}
    assert list(losses) == ["the lstsq map", "the diagonal map"]
    spans = [entry["removed_blocks"] for entry in comparison["candidates"].values()]
    assert spans[0] != spans[1]
    assert comparison["chosen"] == min(losses, key=losses.get)
    assert result.manifest["removed_blocks"] == comparison["candidates"][comparison["chosen"]]["removed_blocks"]
    assert selection["scored_with"].startswith("the lstsq map and the diagonal map")
    own = blockfold.compress(tiny_model("llama"), tokenizer, {**settings, "span_scoring": "estimator"},
                             calibration=calibration).manifest["removed_blocks"]
    assert spans[1] == own
    fixed = tiny_model("llama")
    blockfold.compress(fixed, tokenizer, {**settings, "span_start": result.manifest["removed_blocks"][0]},
                       calibration=calibration)
    for (name, value), (_, expected) in zip(model.state_dict().items(), fixed.state_dict().items()):
        assert torch.equal(value, expected), name


def test_span_scoring_compare_builds_nothing_where_the_scorings_agree_and_refuses_several_spans(tokenizer):
    calibration = random_calibration(num_sequences=16)
    plain = blockfold.compress(tiny_model("llama"), tokenizer, {"blocks": 2}, calibration=calibration).manifest
    compared = blockfold.compress(tiny_model("llama"), tokenizer, {"blocks": 2, "span_scoring": "compare"},
                                  calibration=calibration).manifest
    assert "span_scoring_comparison" not in compared["selection"]
    assert compared["removed_blocks"] == plain["removed_blocks"]
    for conflicting in ({"spans": 2}, {"spans": "auto"}, {"greedy": True, "refit": "none"}):
        with pytest.raises(BlockfoldError, match="span_scoring compare"):
            Recipe.parse({"blocks": 2, "span_scoring": "compare", **conflicting})


def test_spans_auto_keeps_the_count_with_the_lowest_held_out_loss_and_builds_it_in_place(tokenizer):
    """Every count's model is built on a copy without the held-out calibration sequences and scored by
    its next-token loss on them; the count with the lowest loss is the one compressed in place, on all
    the sequences: the same model a fixed count builds."""
    calibration = random_calibration(num_sequences=16)
    model = tiny_model("llama")
    silence_blocks(model, [1, 3, 4])
    result = blockfold.compress(model, tokenizer, {"blocks": 3, "spans": "auto"}, calibration=calibration)
    search = result.manifest["selection"]["span_count_search"]
    losses = {int(count): entry["mean_nll"] for count, entry in search["candidates"].items()}
    assert set(losses) == {1, 2, 3}
    assert search["chosen"] == min(losses, key=lambda count: (losses[count], count))
    # two and three spans of three silent blocks are the same blocks (3 and 4 touch): one model, one loss
    assert search["candidates"][2]["removed_blocks"] == search["candidates"][3]["removed_blocks"] == [1, 3, 4]
    assert losses[2] == losses[3]
    assert result.manifest["removed_blocks"] == search["candidates"][search["chosen"]]["removed_blocks"]
    # four batches of four sequences: the last batch is held out (an eighth, at least one batch)
    assert search["held_out_sequences"] == 4 and search["held_out_tokens"] == 4 * 24

    fixed_model = tiny_model("llama")
    silence_blocks(fixed_model, [1, 3, 4])
    blockfold.compress(fixed_model, tokenizer, {"blocks": 3, "spans": search["chosen"]}, calibration=calibration)
    for (name, value), (_, fixed) in zip(model.state_dict().items(), fixed_model.state_dict().items()):
        assert torch.equal(value, fixed), name


def test_spans_auto_chooses_the_exact_removal_when_one_span_must_damage_the_model(tokenizer):
    """Blocks 1 and 4 silent, every other block made to matter: two spans remove exactly the silent
    ones (the original's loss on the held-out sequences), one span of two must take a live block,
    and auto sees it."""
    from blockfold.eval.perplexity import summed_nll
    from blockfold.methods.replaceme import _hold_out

    calibration = random_calibration(num_sequences=16)
    model = tiny_model("llama")
    adapter = get_adapter(model)
    with torch.no_grad():
        for layer in adapter.layers(model):
            adapter.down_proj(layer).weight.mul_(8.0)
    silence_blocks(model, [1, 4])
    total, tokens = summed_nll(model, _hold_out(calibration)[1])
    result = blockfold.compress(model, tokenizer, {"blocks": 2, "spans": "auto"}, calibration=calibration)
    search = result.manifest["selection"]["span_count_search"]
    assert search["chosen"] == 2 and result.manifest["removed_blocks"] == [1, 4]
    assert math.isclose(search["candidates"][2]["mean_nll"], total / tokens, rel_tol=1e-5)
    assert search["candidates"][1]["mean_nll"] > search["candidates"][2]["mean_nll"]


def test_spans_auto_on_a_streamed_model_equals_the_resident_one(tmp_path):
    """The copies of a model streamed from its checkpoint are skeletons over the same file; the search
    and the saved weights match the resident run."""
    from blockfold.runtime import Execution
    from conftest import tiny_tokenizer

    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    calibration = random_calibration(num_sequences=8)
    searches = []
    for pipeline in ("whole", "sequential"):
        execution = Execution(pipeline=pipeline, chunk_sequences=3)
        handle = blockfold.open_model(str(folder), execution)
        result = blockfold.compress(handle, recipe={"blocks": 2, "spans": "auto"}, calibration=calibration,
                                    execution=execution)
        assert result.manifest["execution"]["pipeline"] == pipeline
        searches.append(result.manifest["selection"]["span_count_search"])
    (whole, sequential) = searches
    assert whole["chosen"] == sequential["chosen"]
    for count, entry in whole["candidates"].items():
        assert entry["removed_blocks"] == sequential["candidates"][count]["removed_blocks"]
        assert math.isclose(entry["mean_nll"], sequential["candidates"][count]["mean_nll"], rel_tol=1e-4)


def test_spans_apart_are_the_criterions_best_at_different_depths():
    from blockfold.select import spans_apart

    scores = np.full((7, 3), np.nan)
    scores[1:6, 2] = [0.1, 0.2, 0.5, 0.3, 0.9]  # spans of 2 starting at 1..5 of a 7-block model
    kept = spans_apart(scores, 2, "fit_error", 3)
    assert [c.start for c in kept] == [1, 4]  # 2 and 3 overlap 1, 5 overlaps 4: nothing else fits apart
    assert [c.score for c in kept] == [0.1, 0.3]
    assert [c.start for c in spans_apart(scores, 2, "fit_error", 1)] == [1]


@pytest.mark.parametrize("settings", [
    {"blocks": 2, "refit": "none"},
    {"blocks": 1, "estimator": "diagonal", "span_scoring": "estimator", "refit": "none"},
    {"blocks": 2, "estimator": "identity", "criterion": "angular_last"},
], ids=["lstsq", "diagonal", "plain-removal"])
def test_shortlist_scores_each_span_as_the_model_with_its_map_fitted_without_the_held_out_sequences(settings):
    """Each shortlisted span's held-out loss is the loss of the model actually built with that span and
    its map fitted on the other sequences alone (the first pass's sums less the held-out ones); the
    span with the lowest is compressed in place, on every sequence, as ``span_start`` builds it."""
    from blockfold.data import CalibrationSet
    from blockfold.eval.perplexity import summed_nll
    from blockfold.methods.replaceme import _hold_out

    tokenizer = tiny_tokenizer()
    calibration = random_calibration(num_sequences=16)
    fitting, held_out = _hold_out(calibration)
    fitting = CalibrationSet(list(fitting.batches), fitting.description)
    model = tiny_model("llama")
    result = blockfold.compress(model, tokenizer, {**settings, "shortlist": 3}, calibration=calibration)
    shortlist = result.manifest["selection"]["shortlist"]
    entries = shortlist["candidates"]
    assert len(entries) >= 2
    starts = [entry["start"] for entry in entries.values()]
    blocks = settings["blocks"]
    assert all(abs(a - b) >= blocks for i, a in enumerate(starts) for b in starts[i + 1:])
    assert [entry["score"] for entry in entries.values()] == sorted(entry["score"] for entry in entries.values())
    total, tokens = summed_nll(tiny_model("llama"), held_out)
    assert math.isclose(shortlist["original_mean_nll"], total / tokens, rel_tol=1e-5)
    for label, entry in entries.items():
        built = tiny_model("llama")
        blockfold.compress(built, tokenizer, {**settings, "span_start": entry["start"], "span_scoring": "lstsq"}
                           if "span_scoring" not in settings else {**settings, "span_start": entry["start"]},
                           calibration=fitting)
        total, tokens = summed_nll(built, held_out)
        assert math.isclose(entry["mean_nll"], total / tokens, rel_tol=1e-4), label
    chosen = shortlist["chosen"]
    assert chosen == min(entries, key=lambda label: entries[label]["mean_nll"])
    assert result.manifest["removed_blocks"] == list(range(entries[chosen]["start"], entries[chosen]["start"] + blocks))
    fixed = tiny_model("llama")
    blockfold.compress(fixed, tokenizer, {**settings, "span_start": entries[chosen]["start"]}, calibration=calibration)
    for (name, value), (_, expected) in zip(model.state_dict().items(), fixed.state_dict().items()):
        assert torch.equal(value, expected), name


def test_shortlist_refuses_what_already_picks_several_spans_or_compares():
    for conflicting in ({"spans": 2}, {"spans": "auto"}, {"greedy": True, "refit": "none"}, {"span_start": 2},
                        {"span_scoring": "compare"}):
        with pytest.raises(BlockfoldError, match="shortlist"):
            Recipe.parse({"blocks": 2, "shortlist": 3, **conflicting})
    assert Recipe.parse({"blocks": 2, "shortlist": 3}).settings.span_scoring == "lstsq"
    with pytest.raises(BlockfoldError, match="--shortlist scores each span.*drop --shortlist"):
        blockfold.compress(tiny_model("llama"), tiny_tokenizer(), {"blocks": 2, "shortlist": 2},
                           calibration=random_calibration(num_sequences=1, batch_size=1))


def test_summed_nll_scores_padded_batches_as_their_sequences_alone():
    """Calibration batches are padded when their texts are short: the padded batch's loss is the sum of
    each sequence's loss on its own, on a resident and a streamed model alike."""
    from blockfold.data import Batch
    from blockfold.eval.perplexity import summed_nll

    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(4)
    sequences = [torch.randint(4, 96, (n,), generator=generator) for n in (20, 13, 7)]
    alone = [summed_nll(model, [Batch(s[None], torch.ones(1, len(s), dtype=torch.long))]) for s in sequences]
    ids = torch.zeros(3, 20, dtype=torch.long)
    mask = torch.zeros(3, 20, dtype=torch.long)
    for row, s in enumerate(sequences):
        ids[row, : len(s)], mask[row, : len(s)] = s, 1
    total, tokens = summed_nll(model, [Batch(ids, mask)])
    assert tokens == sum(t for _, t in alone) == 19 + 12 + 6
    assert math.isclose(total, sum(n for n, _ in alone), rel_tol=1e-5)
    streamed_total, streamed_tokens = summed_nll(handle_of(model), [Batch(ids, mask)])
    assert streamed_tokens == tokens and math.isclose(streamed_total, total, rel_tol=1e-5)


def test_spans_auto_holds_out_an_eighth_of_the_sequences_and_needs_two():
    from blockfold.methods.replaceme import _hold_out

    fitting, held_out = _hold_out(random_calibration(num_sequences=64, batch_size=8))
    assert len(fitting) == 7 and len(held_out) == 1 and len(held_out[0]) == 8
    fitting, held_out = _hold_out(random_calibration(num_sequences=8, batch_size=8))  # one batch: split by rows
    assert [len(b) for b in fitting] == [7] and [len(b) for b in held_out] == [1]
    with pytest.raises(BlockfoldError, match="one sequence leaves none"):
        blockfold.compress(tiny_model("llama"), tiny_tokenizer(), {"blocks": 2, "spans": "auto"},
                           calibration=random_calibration(num_sequences=1, batch_size=1))


def test_spans_auto_is_replaceme_only_and_the_cli_reads_it(capsys):
    from blockfold.cli import build_parser

    assert Recipe.parse({"spans": "auto"}).settings.span_counts(8) == (1, 2, 3)
    assert Recipe.parse({"blocks": 2, "spans": "auto"}).settings.span_counts(2) == (1, 2)
    for given, parsed in (("auto", "auto"), ("2", 2)):
        assert build_parser().parse_args(["compress", "--model", "m", "--out", "o", "--spans", given]).spans == parsed
    with pytest.raises(SystemExit):
        build_parser().parse_args(["compress", "--model", "m", "--out", "o", "--spans", "two"])
    assert "--spans takes a number or auto, not 'two'" in capsys.readouterr().err
    with pytest.raises(BlockfoldError, match="spans"):
        Recipe.parse({"method": "uidl", "spans": "auto"})
    with pytest.raises(BlockfoldError, match="cannot be combined"):
        Recipe.parse({"spans": "auto", "span_start": 3})
