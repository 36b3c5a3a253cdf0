"""The method registry (``settings.SETTINGS``) is the one place a method is declared: the CLI, the
API and the errors read it, and no other source file lists methods by hand."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

import blockfold
from blockfold.cli import main
from blockfold.methods import METHODS
from blockfold.settings import DEFAULT_METHOD, SETTINGS

SOURCE = Path(blockfold.__file__).parent
NAME = re.compile(r"(?<![\w-])(" + "|".join(sorted(map(re.escape, SETTINGS), key=len, reverse=True)) + r")(?![\w-])")


def _names_listed(node: ast.AST) -> set[str]:
    """Method names a literal collection (its string items) or one string (its text) names."""
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = node.elts
    elif isinstance(node, ast.Dict):
        items = [key for key in node.keys if key is not None]
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        return set(NAME.findall(node.value))
    elif isinstance(node, ast.JoinedStr):
        return set(NAME.findall("".join(part.value for part in node.values if isinstance(part, ast.Constant))))
    else:
        return set()
    return {item.value for item in items if isinstance(item, ast.Constant) and item.value in SETTINGS}


def test_no_source_file_but_the_registry_lists_methods():
    listed = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path.name == "settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = _names_listed(node)
            if len(names) >= 3:
                listed.append(f"{path.relative_to(SOURCE)}:{node.lineno}: {sorted(names)}")
    assert not listed, "methods listed by hand (derive them from settings.SETTINGS):\n" + "\n".join(listed)


def test_every_registered_method_runs_and_is_listed(capsys):
    assert set(METHODS) == set(SETTINGS) and DEFAULT_METHOD == "replaceme"
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name, cls in SETTINGS.items():
        assert f"{name}{' (default)' if name == DEFAULT_METHOD else ''}: {cls.summary()}" in out
        assert cls.summary() and "``" not in cls.summary()
    # defaults as a run resolves them, each with its description
    assert re.search(r"\n    refit = all +projections refitted after removal\n", out)
    assert re.search(r"\n    blocks = 8 +blocks to remove", out) and "    cosine.steps = 60" in out
    assert main(["methods", "sleb"]) == 0
    assert capsys.readouterr().out.startswith(f"sleb: {SETTINGS['sleb'].summary()}\n    blocks = 8")


def test_method_flag_offers_the_registry(capsys, tmp_path):
    assert main(["compress", "--model", "m", "--out", str(tmp_path / "o"), "--method", "unknown"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"choose one of {', '.join(SETTINGS)}" in err


def test_the_command_line_reference_is_current():
    from blockfold.cli import reference_markdown

    written = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text(encoding="utf-8")
    assert written == reference_markdown(), "docs/cli.md is stale: run scripts/cli-reference.sh"


@pytest.fixture
def deepest_method(monkeypatch):
    """docs/methods.md's example, registered for one test."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "docs" / "examples"))
    import deepest_method

    yield deepest_method
    SETTINGS.pop("deepest")
    METHODS.pop("deepest", None)
    sys.modules.pop("deepest_method")


def test_a_method_is_added_by_one_registration(deepest_method, tmp_path, capsys):
    """The guide's example: its flags, listing, recipe, dry-run plan, run and refit stage all come from
    the one registration."""
    from conftest import tiny_folder_and_corpus

    from blockfold.cli import build_parser
    from blockfold.plan import plan_for
    from blockfold.recipe import Recipe
    from blockfold.runtime import Execution

    folder, corpus = tiny_folder_and_corpus(tmp_path)
    assert main(["methods", "deepest"]) == 0 and "refit = none" in capsys.readouterr().out
    help_text = build_parser()._subparsers._group_actions[0].choices["compress"].format_help()
    assert "deepest" in help_text
    common = ["--model", str(folder), "--calib", str(corpus), "--num-seqs", "8", "--seq-len", "24", "--method", "deepest",
              "--blocks", "2"]
    for extra, passes in (([], 0), (["--refit", "all"], 2)):
        out = tmp_path / f"out{len(extra)}"
        assert main(["compress", *common, *extra, "--out", str(out)]) == 0
        manifest = json.loads((out / "blockfold_manifest.json").read_text())
        assert manifest["removed_blocks"] == [3, 4] and manifest["execution"]["passes"] == passes
        assert ("refit" in manifest) == bool(extra)
        recipe = Recipe.from_yaml(out / "blockfold_recipe.yaml")
        assert plan_for(str(folder), recipe, Execution()).numbers["passes"] == passes
