"""Results JSON is written whole or not at all: a reader never finds a truncated file."""

import json
import os

import pytest

from blockfold import jsonfile
from blockfold.errors import BlockfoldError
from blockfold.jsonfile import check_json_target, write_json


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


def test_check_json_target_accepts_a_new_file_in_new_folders_and_refuses_what_cannot_be_written(tmp_path):
    check_json_target(tmp_path / "new" / "folder" / "results.json")
    assert list(tmp_path.iterdir()) == []  # a check writes nothing
    with pytest.raises(BlockfoldError, match="is a folder: give a file path"):
        check_json_target(tmp_path)
    (tmp_path / "f").write_text("")
    with pytest.raises(BlockfoldError, match="is a file, not a folder"):
        check_json_target(tmp_path / "f" / "deeper" / "r.json", "--out")
