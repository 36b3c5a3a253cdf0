"""Results JSON is written whole or not at all: a reader never finds a truncated file."""

import json
import os

import pytest

from blockfold import jsonfile
from blockfold.jsonfile import write_json


def test_write_json_makes_the_folder_and_leaves_only_the_file(tmp_path):
    target = tmp_path / "new" / "folder" / "results.json"
    assert write_json(target, {"rows": [1, 2]}) == target
    assert json.loads(target.read_text()) == {"rows": [1, 2]}
    assert os.listdir(target.parent) == ["results.json"]


def test_a_value_json_cannot_hold_leaves_the_previous_file(tmp_path):
    target = tmp_path / "results.json"
    write_json(target, {"rows": [1]})
    with pytest.raises(TypeError):
        write_json(target, {"rows": [object()]})
    assert json.loads(target.read_text()) == {"rows": [1]} and os.listdir(tmp_path) == ["results.json"]


def test_a_write_stopped_before_the_rename_leaves_the_previous_file_and_no_staging(tmp_path, monkeypatch):
    target = tmp_path / "results.json"
    write_json(target, {"rows": [1]})

    def stopped(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(jsonfile.os, "replace", stopped)
    with pytest.raises(KeyboardInterrupt):
        write_json(target, {"rows": [1, 2]})
    assert json.loads(target.read_text()) == {"rows": [1]} and os.listdir(tmp_path) == ["results.json"]


def test_default_serialises_what_json_cannot(tmp_path):
    target = write_json(tmp_path / "r.json", {"path": tmp_path}, default=str)
    assert json.loads(target.read_text()) == {"path": str(tmp_path)}
