"""Every benchmark script imports and parses its options against today's code: a figure in
BENCHMARKS.md must stay reproducible with the command printed next to it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(path.name for path in BENCH.glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_imports_and_shows_its_help(script):
    done = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                          cwd=BENCH.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()


def test_provenance_marks_code_changes_dirty_but_not_results_or_prose(tmp_path, monkeypatch):
    """A benchmark's JSON (or BENCHMARKS.md) being rewritten must not mark a second benchmark's code dirty."""
    import blockfold.api as api

    def status(porcelain: str):
        def run(args, **kwargs):
            out = "abc123\n" if "rev-parse" in args else porcelain
            return subprocess.CompletedProcess(args, 0, stdout=out, stderr="")
        return run

    monkeypatch.setattr(api.subprocess, "run", status(" M bench/results/x.json\n M BENCHMARKS.md\n"))
    assert api.git_commit() == "abc123"
    monkeypatch.setattr(api.subprocess, "run", status(" M bench/results/x.json\n M src/blockfold/api.py\n"))
    assert api.git_commit() == "abc123+dirty"
