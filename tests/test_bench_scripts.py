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
