"""One budget for every method (issue #44): ``sparsity``, the share of the decoder blocks' parameters
removed, resolved against the model into the method's own unit (blocks, attention layers, slice width,
ranks, channels); the run and its saved recipe hold the count that ran, the manifest the share it reached."""

from __future__ import annotations

import pytest
from conftest import random_calibration, tiny_model, tiny_tokenizer

import blockfold
from blockfold.adapters import get_adapter
from blockfold.cli import main
from blockfold.errors import BlockfoldError
from blockfold.recipe import Recipe
from blockfold.settings import NBL, SETTINGS, DropAttention, LinearPatch, ModelSize, ReplaceMe, SliceGPT

#: ten blocks of 100 parameters, 30 of them attention, hidden size 3 (a replacing map: 9 + 3 parameters)
SIZE = ModelSize(block_parameters=(100,) * 10, attention_parameters=(30,) * 10, hidden_size=3)


def test_a_sparsity_resolves_to_the_nearest_count_of_the_methods_own_unit():
    assert ReplaceMe(sparsity=0.3).for_model(SIZE).blocks == 3
    assert ReplaceMe(sparsity=0.34).for_model(SIZE).blocks == 3
    assert ReplaceMe(sparsity=0.36).for_model(SIZE).blocks == 4
    assert DropAttention(sparsity=0.06).for_model(SIZE).attention_layers == 2
    # NBL puts a 3 x 3 map and a bias (12 parameters) in place of each 30-parameter attention: 18 removed each
    assert NBL(sparsity=0.06).for_model(SIZE).attention_layers == 3
    # LinearPatch stores one 12-parameter patch for the span: 3 blocks remove 288 of 1000
    assert LinearPatch(sparsity=0.29).for_model(SIZE).blocks == 3
    resolved = ReplaceMe(sparsity=0.3).for_model(SIZE)
    assert resolved.sparsity is None and Recipe.parse({"method": "replaceme", **resolved.model_dump()}).settings.blocks == 3


def test_without_a_sparsity_the_settings_are_left_as_they_are():
    settings = ReplaceMe(blocks=4)
    assert settings.for_model(SIZE) is settings and ReplaceMe().blocks == 8


@pytest.mark.parametrize("settings, reachable", [(ReplaceMe(sparsity=0.9), "from 0.100 (1 of its 10 blocks) to 0.800 (8)"),
                                                 (NBL(sparsity=0.5), "from 0.018 (1 of its 10 attention layers) to 0.180 (10)")])
def test_a_sparsity_a_method_cannot_reach_is_refused_with_the_range_it_can(settings, reachable):
    with pytest.raises(BlockfoldError) as error:
        settings.for_model(SIZE)
    assert reachable in str(error.value) and "width method" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("method, budget", [("replaceme", "blocks"), ("nbl", "attention_layers"), ("uidl", "ratio")])
def test_one_budget_at_a_time(method, budget):
    with pytest.raises(BlockfoldError, match="give one budget, not"):
        Recipe.parse({"method": method, budget: 0.5 if budget == "ratio" else 2, "sparsity": 0.2})


def test_slicegpt_slicing_is_its_sparsity_and_its_saved_recipe_replays():
    settings = SliceGPT(sparsity=0.3)
    assert settings.slicing == 0.3
    assert Recipe.parse({"method": "slicegpt", **settings.model_dump()}).settings.slicing == 0.3
    assert Recipe.parse({"method": "slicegpt", **settings.model_dump(exclude_unset=True)}).settings.slicing == 0.3
    with pytest.raises(BlockfoldError, match="not slicing"):
        Recipe.parse({"method": "slicegpt", "slicing": 0.25, "sparsity": 0.3})


def test_every_method_takes_a_sparsity():
    for method in SETTINGS:
        assert "sparsity" in SETTINGS[method].model_fields, method


@pytest.mark.parametrize("method, sparsity", [("replaceme", 0.3), ("uidl", 0.3), ("drop-block", 0.5), ("nbl-block", 0.3),
                                              ("linear-patch", 0.3), ("drop-attn", 0.1), ("nbl", 0.07),
                                              ("svd-llm", 0.3), ("llm-pruner", 0.3), ("slicegpt", 0.25)])
def test_the_run_reaches_the_sparsity_within_half_a_unit_and_saves_the_count(method, sparsity):
    model = tiny_model("llama")
    size = get_adapter(model.config).model_size(model)
    resolved = SETTINGS[method](sparsity=sparsity).for_model(size)
    result = blockfold.compress(model, tiny_tokenizer(), {"method": method, "sparsity": sparsity},
                                random_calibration())
    reached = result.manifest["sparsity"]
    assert reached["requested"] == sparsity
    field = SETTINGS[method].budget_field
    unit = {"blocks": size.block_parameters[0], "attention_layers": size.attention_parameters[0]}.get(field)
    # a count of whole units lands within half a unit; the width methods round ranks, channels or widths
    tolerance = unit / sum(size.block_parameters) / 2 if unit else 0.05
    assert reached["blocks"] == pytest.approx(sparsity, abs=tolerance + 1e-9), reached
    saved = result.manifest["recipe"]["settings"]
    assert saved[field] == getattr(resolved, field)
    if field in ("blocks", "attention_layers"):
        assert saved["sparsity"] is None  # the saved recipe replays the count, on any model
        replay = {key: value for key, value in result.manifest["recipe"].items() if key != "blockfold_version"}
        assert Recipe.parse(replay).settings == resolved


def test_the_dry_run_says_what_the_sparsity_resolved_to_and_the_summary_what_it_reached(tmp_path, capsys):
    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{(i * 7 + i // 5) % 90}" for i in range(3000)))
    assert main(["compress", "--model", str(folder), "--sparsity", "0.3", "--calib", str(corpus), "--num-seqs", "8",
                 "--seq-len", "32", "--out", str(tmp_path / "out"), "-q"]) == 0
    assert "sparsity 33.3% of the blocks', 30.0% of the model's; asked 30.0%" in capsys.readouterr().out
    assert main(["compress", "--model", str(folder), "--method", "drop-attn", "--sparsity", "0.1", "--dry-run"]) == 0
    assert "sparsity 0.1: 2 attention layers" in capsys.readouterr().out
    assert main(["compress", "--model", str(folder), "--sparsity", "0.95", "--dry-run"]) == 2
    assert "--sparsity 0.95 cannot be reached by removing blocks" in capsys.readouterr().err
