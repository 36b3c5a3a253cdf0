"""Bounded statistics: only what the criterion needs is accumulated, within a budget; beyond it
ReplaceMe screens its candidates and NBL gathers moments in groups, with the same results where the
screen keeps the winner. The plan (--dry-run) is printed from config.json alone."""

from __future__ import annotations

import pytest
import torch
from conftest import random_calibration, tiny_model, tiny_tokenizer

import blockfold
from blockfold.adapters import get_adapter
from blockfold.cli import main
from blockfold.recipe import RECIPE_VERSION, Recipe
from blockfold.runtime import Execution
from blockfold.stats import SpanStatistics


@pytest.mark.parametrize("pipeline, criterion", [("whole", "fit_error"), ("sequential", "fit_error"),
                                                 ("whole", "fit_error_stream")])
def test_screening_keeps_the_winner_and_says_so(pipeline, criterion):
    """Each fit criterion screens by its own diagonal stand-in (the default's used to screen for both)."""
    calibration = random_calibration(num_sequences=8)
    settings = {"blocks": 1, "criterion": criterion, "refit": "none"}  # the passes of the selection alone
    full = blockfold.compress(tiny_model("llama"), tiny_tokenizer(), settings, calibration,
                              execution=Execution(pipeline=pipeline)).manifest
    assert full["selection"]["statistics"]["sums"] == "full" and full["execution"]["passes"] == 1
    per_start = SpanStatistics.sums_bytes_for(1, 32, "full", criterion == "fit_error_stream")
    screened = blockfold.compress(tiny_model("llama"), tiny_tokenizer(), settings, calibration,
                                  execution=Execution(pipeline=pipeline, stats_memory=3 * per_start)).manifest
    statistics = screened["selection"]["statistics"]
    assert statistics["sums"] == "screened" and statistics["screening"]["kept_per_length"] == 3
    assert statistics["screening"]["by"] == f"the diagonal map's {criterion}"
    assert screened["execution"]["passes"] == 2
    kept = statistics["screening"]["kept"]["1"]
    assert len(kept) == 3 and set(screened["selection"]["candidates"]) == set(kept)
    winner = min(full["selection"]["candidates"], key=full["selection"]["candidates"].get)
    assert winner in kept, "the diagonal map's score should keep the full criterion's winner on this model"
    assert screened["removed_blocks"] == full["removed_blocks"]
    for start in kept:  # the kept candidates' scores are exact
        assert screened["selection"]["candidates"][start] == pytest.approx(full["selection"]["candidates"][start], rel=1e-9)


def test_a_criterion_without_fitted_maps_accumulates_no_normal_equations():
    calibration = random_calibration(num_sequences=8)
    uidl = blockfold.compress(tiny_model("llama"), tiny_tokenizer(), {"method": "uidl", "blocks": 2}, calibration).manifest
    assert uidl["selection"]["statistics"]["sums"] == "none"
    angular = blockfold.compress(tiny_model("llama"), tiny_tokenizer(), {"blocks": 2, "criterion": "angular_last", "refit": "none"},
                                 calibration, execution=Execution(stats_memory=1024)).manifest
    # beyond the budget the chosen span's equations come from one refit pass
    assert angular["selection"]["statistics"]["sums"] == "none" and angular["execution"]["passes"] == 2
    assert angular["transform"]["estimator"] == "lstsq"


@pytest.mark.parametrize("criterion", ["cosine", "cca"])
def test_nbl_beyond_its_budget_chooses_and_fits_the_same(criterion):
    calibration = random_calibration(num_sequences=8)
    recipe = {"method": "nbl", "attention_layers": 2, "linearity_criterion": criterion}
    full_model, small_model = tiny_model("llama"), tiny_model("llama")
    full = blockfold.compress(full_model, tiny_tokenizer(), recipe, calibration).manifest
    per_layer = 5 * 32 * 32 * 8
    small = blockfold.compress(small_model, tiny_tokenizer(), recipe, calibration,
                               execution=Execution(stats_memory=2 * per_layer)).manifest
    assert small["replaced"] == full["replaced"]
    assert small["execution"]["passes"] == (1 if criterion == "cosine" else 3) + 1
    for layer in full["replaced"]["layers"]:
        a, b = full_model.model.layers[layer].self_attn.linear, small_model.model.layers[layer].self_attn.linear
        assert torch.allclose(a.weight, b.weight, atol=1e-6) and torch.allclose(a.bias, b.bias, atol=1e-6)


def test_dry_run_plans_from_config_json_alone(capsys, tmp_path):
    config = tmp_path / "config.json"
    tiny_model("llama").config.to_json_file(config)
    assert main(["compress", "--model", str(config), "--out", str(tmp_path / "o"), "--blocks", "2", "--calib",
                 "x.jsonl", "--num-seqs", "16", "--seq-len", "64", "--dry-run", "1GiB"]) == 0
    printed = capsys.readouterr().out
    for needle in ("weights", "pipeline", "statistics", "passes", "peak memory", "time on H100"):
        assert needle in printed
    assert not (tmp_path / "o").exists()
    # a plan needs no output folder; a run does, and says so in one line
    assert main(["compress", "--model", str(config), "--blocks", "2", "--dry-run", "1GiB"]) == 0
    assert "passes" in capsys.readouterr().out
    assert main(["compress", "--model", str(config), "--blocks", "2"]) == 2
    error = capsys.readouterr().err.strip()
    assert "--out DIR" in error and len(error.splitlines()) == 1


def test_dry_run_numbers_for_the_big_configs():
    """The figures docs/scale.md quotes: Llama-3-8B whole with all sums; Llama-3.1-70B layer by layer, screened."""
    from pathlib import Path

    from blockfold.plan import plan_for

    configs = Path(__file__).resolve().parents[1] / "bench" / "configs"
    calibration = {"source": "c4.jsonl", "num_sequences": 256, "sequence_length": 2048}
    small = plan_for(str(configs / "llama-3-8b" / "config.json"), Recipe.parse({"blocks": 8, "calibration": calibration}),
                     Execution(), 80 << 30).numbers
    # fit_error needs two d x d sums per candidate start (xtx, xty); fit_error_stream's weighted sums double it
    # one pass of selection statistics, two of the default refit (the original streams, then both side by side)
    assert small["pipeline"] == "whole" and small["passes"] == 3 and small["sums_bytes"] == 24 * 2 * 4096**2 * 8
    stream = plan_for(str(configs / "llama-3-8b" / "config.json"),
                      Recipe.parse({"blocks": 8, "criterion": "fit_error_stream", "calibration": calibration}),
                      Execution(), 80 << 30).numbers
    assert stream["sums_bytes"] == 2 * small["sums_bytes"]
    big = plan_for(str(configs / "llama-3.1-70b" / "config.json"), Recipe.parse({"blocks": 20, "calibration": calibration}),
                   Execution(), 80 << 30).numbers
    assert big["pipeline"] == "sequential" and big["passes"] == 4 and big["peak_bytes"] < 80 << 30
    assert big["sums_bytes"] <= big["budget_bytes"]
    # --spans auto: each of the 1, 2, 3-span candidates built and scored, then the chosen count built again
    searched = plan_for(str(configs / "llama-3.1-70b" / "config.json"),
                        Recipe.parse({"blocks": 20, "spans": "auto", "calibration": calibration}),
                        Execution(), 80 << 30).numbers
    assert searched["passes"] == 18 and searched["peak_bytes"] < 80 << 30


def test_version_1_recipes_are_read_with_their_defaults(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("recipe_version: 1\nmethod: replaceme\nblocks: 3\nattention_layers: null\nratio: null\n"
                   "estimator: lstsq\nrank: null\nspan_start: null\nridge_alpha: 0.0\ncriterion: null\nspans: 1\n"
                   "linearity_criterion: cosine\ngreedy: false\nsandwich_fold: auto\n"
                   "calibration: {num_sequences: 8}\ncosine: {max_tokens: 16384, steps: 60, learning_rate: 1.0, l1_penalty: 0.0}\n")
    recipe = Recipe.from_yaml(old)
    assert recipe.recipe_version == RECIPE_VERSION and recipe.settings.blocks == 3
    assert recipe.settings.sandwich_fold == "compare"  # version 3's auto compared the folds' losses
    assert recipe.calibration.document_separator == "blank-line" and not recipe.calibration.start_every_sequence
    assert recipe.settings.criterion == "fit_error_stream" and recipe.calibration.num_sequences == 8
    again = Recipe.parse(Recipe.from_yaml(old).model_dump(mode="json"))
    assert again == recipe


def test_version_2_recipes_run_as_they_did(tmp_path):
    """Version 2 packed with blank lines and no start per sequence, and its ReplaceMe ridge was a total:
    migrated, the same run comes out (the ridge per token of the recipe's tokens)."""
    old = tmp_path / "v2.yaml"
    old.write_text("recipe_version: 2\nmethod: replaceme\nsettings: {blocks: 3, ridge_alpha: 2048.0}\n"
                   "calibration: {num_sequences: 8, sequence_length: 128}\n")
    recipe = Recipe.from_yaml(old)
    assert recipe.recipe_version == RECIPE_VERSION and recipe.settings.ridge_alpha == 2.0
    assert recipe.calibration.document_separator == "blank-line" and not recipe.calibration.start_every_sequence
    assert Recipe.parse({"blocks": 3}).calibration.document_separator == "eos"


def test_version_3_auto_fold_replays_as_compare():
    """Version 3's auto kept the sandwich fold with the lower loss; version 4's auto folds
    linearized-norm. A version 3 recipe, written or defaulted, still compares; a forced fold stays."""
    for settings in ({"blocks": 3}, {"blocks": 3, "sandwich_fold": "auto"}):
        migrated = Recipe.parse({"recipe_version": 3, "method": "replaceme", "settings": settings})
        assert migrated.recipe_version == RECIPE_VERSION and migrated.settings.sandwich_fold == "compare"
    forced = Recipe.parse({"recipe_version": 3, "settings": {"blocks": 3, "sandwich_fold": "through-norm"}})
    assert forced.settings.sandwich_fold == "through-norm"
    plain = Recipe.parse({"recipe_version": 3, "settings": {"blocks": 3, "estimator": "identity"}})
    assert plain.settings.sandwich_fold == "auto"  # identity folds nothing, and refuses any other value
    constrained = Recipe.parse({"recipe_version": 3, "settings": {"blocks": 3, "estimator": "diagonal"}})
    assert constrained.settings.sandwich_fold == "auto"  # v3 folded it linearized-norm, as v4's auto does
    assert Recipe.parse({"blocks": 3}).settings.sandwich_fold == "auto"


def test_version_4_recipes_keep_the_span_criterion_they_defaulted_to():
    """Version 5's default criterion is fit_error; a version 4 (or older) recipe that left it to the
    default selected by fit_error_stream and still does; a criterion it names stays, as does UIDL's."""
    for version in (2, 3, 4):
        migrated = Recipe.parse({"recipe_version": version, "method": "replaceme", "settings": {"blocks": 3}})
        assert migrated.recipe_version == RECIPE_VERSION and migrated.settings.criterion == "fit_error_stream"
    named = Recipe.parse({"recipe_version": 4, "settings": {"blocks": 3, "criterion": "cka"}})
    assert named.settings.criterion == "cka"
    flat = Recipe.parse({"recipe_version": 4, "blocks": 3, "criterion": "cca"})
    assert flat.settings.criterion == "cca"
    uidl = Recipe.parse({"recipe_version": 4, "method": "uidl", "settings": {"blocks": 3}})
    assert uidl.settings.criterion == "angular_last"
    assert Recipe.parse({"blocks": 3}).settings.criterion == "fit_error"
    assert Recipe.parse(Recipe.parse({"recipe_version": 4, "settings": {"blocks": 3}}).model_dump(mode="json")) \
        .settings.criterion == "fit_error_stream"  # saved again as version 6, the resolved value stays


def test_version_5_nbl_recipes_keep_the_cosine_ranking_they_defaulted_to():
    """Version 6's NBL default is auto (nmse on sandwich-norm attention); a version 5 (or older) NBL
    recipe that left the ranking to the default ranked by cosine on every architecture, and still does."""
    for version in (2, 3, 4, 5):
        migrated = Recipe.parse({"recipe_version": version, "method": "nbl", "settings": {"attention_layers": 2}})
        assert migrated.recipe_version == RECIPE_VERSION and migrated.settings.linearity_criterion == "cosine"
    named = Recipe.parse({"recipe_version": 5, "method": "nbl", "settings": {"attention_layers": 2,
                                                                           "linearity_criterion": "cca"}})
    assert named.settings.linearity_criterion == "cca"
    block = Recipe.parse({"recipe_version": 5, "method": "nbl-block", "settings": {"blocks": 2}})
    assert block.settings.linearity_criterion == "cosine"
    assert Recipe.parse({"method": "nbl", "attention_layers": 2}).settings.linearity_criterion == "auto"


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_nbl_auto_ranking_follows_the_attention_norm_and_is_recorded(arch):
    """auto ranks by nmse where attention's output is normed before the residual add (Gemma) and by
    cosine elsewhere; the manifest names the ranking that ran and the rule that chose it."""
    model = tiny_model(arch)
    expected = "nmse" if arch == "gemma3_text" else "cosine"
    assert blockfold.NBL().resolved_criterion(get_adapter(model)) == expected
    result = blockfold.compress(model, tiny_tokenizer(), {"method": "nbl", "attention_layers": 1},
                                random_calibration(num_sequences=8))
    selection = result.manifest["selection"]
    assert selection["criterion"] == expected and selection["criterion_rule"].startswith("auto")
    assert result.manifest["replaced"]["layers"] == [min(selection["candidates"], key=selection["candidates"].get)]
    assert selection["candidates"] == selection["scores_per_criterion"][expected]
    assert result.manifest["recipe"]["settings"]["linearity_criterion"] == "auto"


def test_ridge_means_the_same_per_token_for_replaceme_and_nbl():
    """The same ridge_alpha shrinks a ReplaceMe map the same whatever the calibration size (it is per
    token, as NBL's is added to the covariance): doubling the data leaves the map unchanged."""
    from blockfold.estimate import fit_span_map
    from blockfold.stats import NormalEquations

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 6, generator=generator, dtype=torch.float64)
    y = x @ torch.randn(6, 6, generator=generator, dtype=torch.float64) + 0.1 * torch.randn(256, 6, generator=generator, dtype=torch.float64)

    def equations(rows: int) -> NormalEquations:
        xs, ys = x.repeat(rows // 256, 1), y.repeat(rows // 256, 1)
        return NormalEquations(xs.T @ xs, xs.T @ ys, float((ys * ys).sum()), float(((xs - ys) ** 2).sum()), rows)

    small, info = fit_span_map(equations(256), "lstsq", ridge_alpha=0.5)
    large, _ = fit_span_map(equations(1024), "lstsq", ridge_alpha=0.5)
    plain, _ = fit_span_map(equations(256), "lstsq")
    assert torch.allclose(small, large, atol=1e-10) and not torch.allclose(small, plain, atol=1e-3)
    assert info["ridge_alpha"] == 0.5


def test_layer_groups_fit_the_budget_with_at_least_one_layer_each():
    """What NBL and SVD-LLM (and their plans) split their passes by."""
    from blockfold.stats.sums import layer_groups

    assert layer_groups([0, 1, 2, 3, 4], per_layer_bytes=10, budget=25) == [[0, 1], [2, 3], [4]]
    assert layer_groups([3, 7], per_layer_bytes=10, budget=5) == [[3], [7]]
    assert layer_groups([0, 1, 2], per_layer_bytes=10, budget=1000) == [[0, 1, 2]]
