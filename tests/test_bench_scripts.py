"""Every benchmark script imports and parses its options against today's code: a figure in
BENCHMARKS.md must stay reproducible with the command printed next to it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(path.name for path in BENCH.glob("*.py"))


def _bench_module(name: str):
    """Import ``bench/<name>.py`` (the bench folder is not a package) to test its helpers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: runs each script as ``python SCRIPT --help`` would, one after the other in one fresh interpreter
#: (torch and transformers imported once, not once per script)
HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys
results = {}
for path in sys.argv[1:]:
    shown, code = io.StringIO(), None
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(shown):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exit:
        code = exit.code or 0
    except BaseException as error:
        code = f"{type(error).__name__}: {error}"
    results[path] = {"code": code, "shown": shown.getvalue()}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps() -> dict:
    done = subprocess.run([sys.executable, "-c", HELP_RUNNER, *(str(BENCH / script) for script in SCRIPTS)],
                          capture_output=True, text=True, cwd=BENCH.parent, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_imports_and_shows_its_help(script, helps):
    result = helps[str(BENCH / script)]
    assert result["code"] == 0, result
    assert "usage" in result["shown"].lower()


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


def test_serving_bench_makes_a_plain_folder_and_each_part_keeps_the_other(tmp_path):
    """bench/serving.py --part llamacpp: the converted folder without its GGUF record, and a merge into
    the serving JSON that leaves the engine rows (vLLM's among them) as they are."""
    import json

    serving = _bench_module("serving")
    converted = tmp_path / "converted"
    converted.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "blockfold_source.json"):
        (converted / name).write_text(name)
    plain = serving.plain_folder(converted, tmp_path / "plain")
    assert sorted(p.name for p in plain.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (plain / "model.safetensors").is_symlink() and (plain / "model.safetensors").read_text() == "model.safetensors"
    assert serving.plain_folder(converted, tmp_path / "plain") == plain  # again: the links are there already
    results = tmp_path / "serving.json"
    results.write_text(json.dumps({"provenance": {}, "models": [{"model": "m", "variants": ["vllm rows"]}]}))
    merged = serving._merged(results, {"llamacpp": {"models": []}})
    assert merged["models"] == [{"model": "m", "variants": ["vllm rows"]}] and merged["llamacpp"] == {"models": []}
    assert serving._merged(tmp_path / "absent.json", {"llamacpp": {}}) == {"llamacpp": {}}


def test_new_methods_bench_keeps_the_original_before_any_row(tmp_path):
    """The file bench/new_methods.py writes once the original is measured, before any method's row, serves
    ``--original-from`` (a long harness run stopped part way keeps the original's quarter hour); a different
    limit is still refused."""
    new_methods = _bench_module("new_methods")
    accuracy = {"piqa": {"acc": 0.6}}
    results = {"model": "gemma3-270m", "tasks": ["piqa"], "limit": 500, "eval_dtype": "float32",
               "original": {"accuracy": accuracy}, "rows": []}
    path = tmp_path / "part1.json"
    new_methods.write_json(str(path), results)
    assert new_methods.earlier_original([str(path)], "gemma3-270m", ["piqa"], 500, "float32", []) == {"accuracy": accuracy}
    with pytest.raises(SystemExit, match="same model, tasks, limit and dtype"):
        new_methods.earlier_original([str(path)], "gemma3-270m", ["piqa"], 100, "float32", [])
    with pytest.raises(SystemExit, match="same model and --windows"):  # it measured no perplexity
        new_methods.earlier_original([str(path)], "gemma3-270m", ["piqa"], 500, "float32", ["C4 (held out)"])
    perplexity = {"C4 (held out)": 30.0}
    new_methods.write_json(str(path), results | {"original": {"perplexity": perplexity}})
    assert new_methods.earlier_original([str(path)], "gemma3-270m", [], 500, "float32", ["C4 (held out)"]) == \
        {"perplexity": perplexity}
    with pytest.raises(SystemExit, match="same model and --windows"):
        new_methods.earlier_original([str(path)], "smollm2-135m", [], 500, "float32", ["C4 (held out)"])

    # a run that measures both takes each from the file that has it
    scores = tmp_path / "accuracy.json"
    new_methods.write_json(str(scores), results)
    assert new_methods.earlier_original([str(path), str(scores)], "gemma3-270m", ["piqa"], 500, "float32",
                                        ["C4 (held out)"]) == {"accuracy": accuracy, "perplexity": perplexity}


def test_qwen_quality_builds_a_sweep_blockfold_parses(tmp_path):
    """The 1.5B table's commands parse as blockfold sweeps (both calibrations), and the code text holds the
    package's sources in file-name order."""
    from blockfold.cli import build_parser

    qwen = _bench_module("qwen_quality")
    code = qwen.code_text("jinja2", tmp_path / "texts" / "code.txt")
    text = code.read_text(encoding="utf-8")
    assert text.index("# jinja2/__init__.py") < text.index("# jinja2/utils.py")
    for calibration in ("default", "instruct"):
        args = build_parser().parse_args(qwen.command(calibration, str(tmp_path / "out"), code, 5))
        assert args.model == "qwen2.5-coder-1.5b" and args.budgets == "4,7,10"
        assert str(code) in args.held_out
        assert (args.calib is None) == (calibration == "default")


def test_new_methods_bench_resumes_only_its_own_command_at_its_own_commit(tmp_path):
    """A bench/new_methods.py run stopped part way continues from its file when the same command runs again at
    the same clean commit; another command's, another commit's or a dirty tree's file is not resumed."""
    new_methods = _bench_module("new_methods")
    started = {"command": "bench/new_methods.py --blocks 12", "commit": "abc123", "date": "later"}
    path = tmp_path / "rows.json"
    assert new_methods.earlier_run(str(path), started) is None  # nothing there yet
    written = {"provenance": started | {"date": "earlier"}, "original": {"parameters": 1}, "rows": [{"method": "uidl"}]}
    new_methods.write_json(str(path), written)
    assert new_methods.earlier_run(str(path), started)["rows"] == [{"method": "uidl"}]
    assert new_methods.earlier_run(str(path), started | {"commit": "def456"}) is None
    assert new_methods.earlier_run(str(path), started | {"command": "bench/new_methods.py --blocks 8"}) is None
    new_methods.write_json(str(path), written | {"provenance": started | {"commit": "abc123+dirty"}})
    assert new_methods.earlier_run(str(path), started | {"commit": "abc123+dirty"}) is None
    new_methods.write_json(str(path), written | {"provenance": started | {"commit": None}})
    assert new_methods.earlier_run(str(path), started | {"commit": None}) is None  # installed from a wheel
    new_methods.write_json(str(path), {"provenance": started, "rows": []})  # stopped before the original was measured
    assert new_methods.earlier_run(str(path), started) is None
