"""Recipes saved by blockfold replay as they ran (docs/design.md, "Recipes and versions").

``tests/data/recipes`` holds the recipe blockfold 0.2.0 (main of 2026-12-06) saved for each method, as
it writes one beside every output; a method added later, the recipe main saved the day it was added
(svd-llm, slicegpt, llm-pruner: 2026-12-07). A saved recipe names every value, so no default of a later
blockfold is consulted when it is replayed; ``recipe_version`` changes only with the schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from blockfold.recipe import RECIPE_VERSION, CalibrationConfig, Recipe
from blockfold.settings import SETTINGS, ReplaceMe

SAVED = Path(__file__).parent / "data" / "recipes"


def _saved(method: str) -> dict:
    return yaml.safe_load((SAVED / f"{method}.yaml").read_text())


def _nested_keys(model_class, values: dict) -> set[str]:
    """The fields of ``model_class`` (nested groups by dotted key) that ``values`` leaves out."""
    missing = set()
    for field, info in model_class.model_fields.items():
        if field not in values:
            missing.add(field)
        elif isinstance(values[field], dict) and hasattr(info.annotation, "model_fields"):
            missing |= {f"{field}.{key}" for key in _nested_keys(info.annotation, values[field])}
    return missing


#: settings added after blockfold 0.2.0 saved these recipes, each with the value that does what 0.2.0
#: did (docs/design.md, "Recipes and versions"): a saved recipe lacks them and replays with that value
ADDED_SINCE_SAVED = {
    "sleb": {"score_sequences": None, "sparsity": None}, "replaceme": {"shortlist": 1, "sparsity": None},
    # the sparsity budget every method takes (a saved recipe names its count of blocks or layers instead)
    **{method: {"sparsity": None} for method in ("drop-attn", "drop-block", "laco", "linear-patch", "nbl", "nbl-block",
                                                 "prune-comp", "slicegpt", "streamline", "uidl")},
}


def test_every_method_has_a_recipe_saved_by_an_earlier_blockfold():
    assert {path.stem for path in SAVED.glob("*.yaml")} == set(SETTINGS), (
        "save one per method: Recipe.parse({'method': NAME, ...}).to_yaml() into tests/data/recipes/NAME.yaml")


@pytest.mark.parametrize("method", sorted(SETTINGS))
def test_a_saved_recipe_names_every_value_and_replays_as_saved(method):
    saved = _saved(method)
    added = ADDED_SINCE_SAVED.get(method, {})
    assert saved["blockfold_version"] == "0.2.0" and saved["recipe_version"] == RECIPE_VERSION
    assert _nested_keys(SETTINGS[method], saved["settings"]) == set(added), \
        "a saved recipe leaves nothing to a default but the settings added since"
    assert not _nested_keys(CalibrationConfig, saved["calibration"])
    replayed = Recipe.from_yaml(SAVED / f"{method}.yaml")
    again = replayed.saved()
    assert {key: again[key] for key in saved if key != "blockfold_version"} == {
        key: value | added if key == "settings" else value for key, value in saved.items()
        if key != "blockfold_version"}
    # a field added since is a stage the saved run did not have, and stays off
    assert {key: again[key] for key in again.keys() - saved.keys()} == ({} if "heal" in saved else {"heal": None})
    # every value came from the file: none was left for a default to fill but the settings added since
    assert replayed.settings.model_fields_set == set(SETTINGS[method].model_fields) - set(added)


def test_a_new_default_changes_hand_written_recipes_but_not_saved_ones(monkeypatch):
    """A later blockfold with another default refit: the recipe a run saved keeps what it ran, a recipe
    that leaves the setting out takes the new default, and neither needs a migration or a new version."""
    monkeypatch.setattr(ReplaceMe, "default_refit", lambda self: "down")
    assert Recipe.from_yaml(SAVED / "replaceme.yaml").settings.refit == "all"
    hand_written = Recipe.parse({"method": "replaceme", "settings": {"blocks": 4}})
    assert hand_written.settings.refit == "down" and hand_written.recipe_version == RECIPE_VERSION
