"""The README's and the user guide's commands stay true: every ``blockfold`` command line in them
parses with today's parser (no renamed or removed flag), and every Python block compiles."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from blockfold.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "guide.md"]


def _blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), re.S)


def _commands(path: Path) -> list[str]:
    """Each ``blockfold`` command of the document's bash blocks, continuation lines joined, comments and
    what follows ``&&`` dropped."""
    commands = []
    for block in _blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].split("&&")[0].strip()
            if line.startswith(".venv/bin/blockfold "):
                commands.append(line.removeprefix(".venv/bin/blockfold "))
    return commands


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: path.name)
def test_every_documented_command_parses(path, capsys):
    commands = _commands(path)
    assert commands, f"no blockfold command found in {path.name}"
    for command in commands:
        build_parser().parse_args(shlex.split(command))
        assert "is now" not in capsys.readouterr().err, f"{path.name} uses a renamed flag: {command}"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: path.name)
def test_every_documented_python_block_compiles(path):
    for block in _blocks(path, "python"):
        compile(block, str(path), "exec")
