"""Issue #16's methods against the baselines on a real model, at one budget, in one run: WikiText-2
perplexity on the windows the project reports (0-39) and on held-out text (later WikiText-2
windows, C4 documents the calibration never saw, LAMBADA passages), the compress time in units of
one calibration pass (a ratio measured in the same run, so only as steady as the machine), the block
forward passes compress ran, counted by hooks on the decoder blocks, in units of one pass of the
calibration set through every block of the original (machine-independent), and the parameter count.

    .venv/bin/python bench/new_methods.py --model smollm2-135m --blocks 8
    .venv/bin/python bench/new_methods.py --model gemma3-270m --blocks 4 --methods prune-comp,laco,linear-patch
    .venv/bin/python bench/new_methods.py --no-perplexity --tasks piqa,arc_easy,hellaswag,lambada_openai --limit 500
    .venv/bin/python bench/new_methods.py --no-perplexity --tasks ... --methods sleb,laco \
        --original-from bench/results/new_methods_accuracy.json --json bench/results/new_methods_accuracy_part2.json

Each method is ``blockfold.compress`` with its defaults (``method:key=value`` changes one setting,
e.g. ``prune-comp:compensate=false`` for the paper's ablation) on the issue-2 recipe: c4_demo
documents 0-127, 64 x 512 tokens.

The same command started again at the same clean commit continues the file its first run left (the
original's figures and the finished rows kept, the other rows run), so a session's end costs at most one row.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

import blockfold
from blockfold.adapters import get_adapter
from blockfold.api import as_handle, count_parameters, provenance
from blockfold.data import build_calibration
from blockfold.eval.tasks import evaluate_tasks, relative_performance
from blockfold.jsonfile import write_json
from blockfold.pipelines import Runner
from blockfold.recipe import CalibrationConfig, Recipe
from blockfold.settings import SETTINGS, BlockBudget
from blockfold.stats import SpanStatistics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from defaults_validation import CALIBRATION_DOCUMENTS, DATA, evaluation_texts, measure  # noqa: E402


def count_block_tokens(model) -> list[int]:
    """A counter of the token positions every decoder block of ``model`` (and every copy of one) is run on."""
    counter = [0]

    def count(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        counter[0] += hidden.shape[0] * hidden.shape[1] if hidden.dim() == 3 else hidden.shape[0]

    for layer in get_adapter(model).layers(model):
        layer.register_forward_pre_hook(count, with_kwargs=True)
    return counter


def accuracy(model, tokenizer, tasks: list[str], limit: int, dtype: torch.dtype) -> dict:
    """Harness accuracy (0-shot, the first ``limit`` examples) of a ``dtype`` copy of ``model``."""
    return evaluate_tasks(copy.deepcopy(model).to(dtype), tokenizer, tasks, limit=limit, batch_size=32)


def evaluation_dtype(name: str, device: str) -> torch.dtype:
    """bfloat16 on an accelerator (what users serve); float32 on a CPU, where bfloat16 matmuls without
    native support are emulated: piqa's first 100 examples on SmolLM2-135M took 149 s in bfloat16
    against 32 s in float32 on the 2-core EPYC without AVX-512 (2026-12-03)."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def earlier_original(paths: list[str], model: str, tasks: list[str], limit: int, dtype_name: str,
                     texts: list[str]) -> dict:
    """The original's harness accuracy (with ``tasks``) and perplexity on ``texts`` (where given) from earlier
    runs of the same model, tasks, limit and dtype (each figure from the first of ``paths`` that measured it),
    so a run that adds rows to a table does not spend minutes (a quarter of an hour for the harness)
    re-measuring the same model."""
    runs = {}
    for path in paths:
        try:
            runs[path] = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            runs[path] = error
        if not isinstance(runs[path], dict):
            raise SystemExit(f"--original-from {path}: not a results JSON ({runs[path]}); give a file a run of this "
                             "bench wrote")
    taken = {}
    if tasks:
        wanted = {"model": model, "tasks": tasks, "limit": limit, "eval_dtype": dtype_name}
        found = {path: {key: earlier.get(key) for key in wanted} for path, earlier in runs.items()}
        same = [path for path, earlier in runs.items() if found[path] == wanted and "accuracy" in earlier.get("original", {})]
        if not same:
            raise SystemExit(f"--original-from {', '.join(paths)}: they measured {list(found.values())}, this run "
                             f"measures {wanted}; give a run of the same model, tasks, limit and dtype, or leave the "
                             "option out to measure the original here")
        taken["accuracy"] = runs[same[0]]["original"]["accuracy"]
    if texts:
        measured = {path: sorted(earlier.get("original", {}).get("perplexity", {})) for path, earlier in runs.items()}
        same = [path for path, earlier in runs.items() if earlier.get("model") == model and measured[path] == sorted(texts)]
        if not same:
            raise SystemExit(f"--original-from {', '.join(paths)}: they measured the perplexity of "
                             f"{[(earlier.get('model'), measured[path]) for path, earlier in runs.items()]}, this run "
                             f"measures {model} on {sorted(texts)}; give a run of the same model and --windows, or "
                             "leave the option out to measure the original here")
        taken["perplexity"] = runs[same[0]]["original"]["perplexity"]
    return taken


def parse_method(spec: str) -> tuple[str, dict]:
    """``prune-comp:compensate=false,importance=perplexity`` → ("prune-comp", {...})."""
    method, _, rest = spec.partition(":")
    settings = {}
    for item in filter(None, rest.split(";")):
        key, _, value = item.partition("=")
        settings[key] = {"true": True, "false": False}.get(value.lower(), value)
    return method, settings


def earlier_run(path: str, started: dict) -> dict | None:
    """What an earlier run of the same command at the same commit wrote to ``path`` (the original's figures and
    its finished rows), so a run stopped part way (a session's end, a restart) continues where it stopped;
    None where there is no such file, and where this run's code is not a clean commit (a dirty tree, a wheel).
    Another command's or another commit's file is replaced, as before."""
    if not started["commit"] or started["commit"].endswith("+dirty"):
        return None
    try:
        earlier = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    same = all(earlier.get("provenance", {}).get(key) == started[key] for key in ("command", "commit"))
    return earlier if same and "original" in earlier else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--methods", default="replaceme,prune-comp,prune-comp:compensate=false,laco,linear-patch,"
                                              "linear-patch:patch=full,drop-block,uidl",
                        help="comma-separated; method:key=value;key=value changes settings")
    parser.add_argument("--windows", type=int, default=20, help="windows of 512 tokens per held-out text")
    parser.add_argument("--json", default="bench/results/new_methods.json")
    parser.add_argument("--tasks", default="", help="harness tasks, comma-separated (e.g. piqa,arc_easy,hellaswag,"
                                                    "lambada_openai), run on a copy of each model in --eval-dtype")
    parser.add_argument("--limit", type=int, default=500, help="first N examples per task")
    parser.add_argument("--eval-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="the copy the harness runs (auto: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--no-perplexity", action="store_true", help="harness accuracy only")
    parser.add_argument("--original-from", default=None,
                        help="take the original's accuracy and perplexity from these earlier results JSONs (comma-"
                             "separated; same model, tasks, limit, dtype and --windows) instead of measuring them again")
    parser.add_argument("--device", default="cpu", help="where the models run (cuda: the harness tables take minutes "
                                                        "there, hours on two CPU cores)")
    parser.add_argument("--sleb-sequences", type=int, default=4,
                        help="SLEB alone calibrates on this many sequences of 256 tokens: it scores every "
                             "remaining block with the whole model's loss at every step (issue #3's setting); a "
                             "sleb row that sets score_sequences takes the recipe's calibration and scores on "
                             "its first sequences instead (so a refit after it fits on all)")
    parser.add_argument("--num-seqs", type=int, default=64,
                        help="calibration sequences of 512 tokens from the same documents 0-127 (the recipe: 64; "
                             "they hold 142)")
    args = parser.parse_args()
    tasks = [task for task in args.tasks.split(",") if task]
    dtype = evaluation_dtype(args.eval_dtype, args.device)
    dtype_name = str(dtype).removeprefix("torch.")

    results = {"provenance": provenance(["bench/new_methods.py", *sys.argv[1:]]), "model": args.model,
               "blocks": args.blocks, "rows": []}
    resumed = earlier_run(args.json, results["provenance"])
    if resumed is not None:
        print(f"resuming {args.json}: {len(resumed['rows'])} rows done", flush=True)
        resumed.setdefault("resumed", []).append(results["provenance"]["date"])
        results = resumed
    loaded = blockfold.load_model(args.model, device=args.device)
    calibration = build_calibration(CalibrationConfig(source=str(DATA / "c4_demo.jsonl"),
                                                      max_documents=CALIBRATION_DOCUMENTS,
                                                      num_sequences=args.num_seqs), loaded.tokenizer)
    sleb_calibration = build_calibration(CalibrationConfig(source=str(DATA / "c4_demo.jsonl"),
                                                           max_documents=CALIBRATION_DOCUMENTS,
                                                           num_sequences=args.sleb_sequences, sequence_length=256),
                                         loaded.tokenizer)
    results["calibration"] = calibration.description
    results["num_layers"] = loaded.model.config.num_hidden_layers
    texts = evaluation_texts(loaded.tokenizer, args.windows)
    if resumed is None:  # the original's figures: measured, or taken from --original-from
        earlier = (earlier_original(args.original_from.split(","), args.model, tasks, args.limit, dtype_name,
                                    [] if args.no_perplexity else list(texts)) if args.original_from else {})
        handle = as_handle(copy.deepcopy(loaded.model), loaded.tokenizer, None)
        started = time.perf_counter()
        Runner(handle).run(calibration, [SpanStatistics(handle.num_layers(), max_length=1)], "reference pass")
        results["pass_seconds"] = time.perf_counter() - started
        results["original"] = {"parameters": count_parameters(loaded.model)}
        if earlier:
            results["original"] |= earlier
            results["original_from"] = args.original_from
        if not args.no_perplexity and "perplexity" not in earlier:
            results["original"]["perplexity"] = measure(loaded.model, texts, "original")
        if tasks:
            results["tasks"], results["limit"], results["eval_dtype"] = tasks, args.limit, dtype_name
            if "accuracy" not in earlier:
                results["original"]["accuracy"] = accuracy(loaded.model, loaded.tokenizer, tasks, args.limit, dtype)
        write_json(args.json, results)  # now and after every row: a run stopped part way keeps the original
    pass_seconds = results["pass_seconds"]
    done = {row["method"] for row in results["rows"]}
    for spec in (spec for spec in args.methods.split(",") if spec not in done):
        method, settings = parse_method(spec)
        model = copy.deepcopy(loaded.model)
        counted = count_block_tokens(model)
        method_calibration = sleb_calibration if method == "sleb" and "score_sequences" not in settings else calibration
        started = time.perf_counter()
        # a width method keeps its own budget (sparsity, slicing), which the row's settings give
        budget = ({"blocks": args.blocks} if issubclass(SETTINGS[method], BlockBudget)
                  and not settings.keys() & {"sparsity", "ratio"} else {})
        result = blockfold.compress(model, loaded.tokenizer, Recipe.parse({"method": method, **budget, **settings}),
                                    calibration=method_calibration)
        seconds = time.perf_counter() - started
        method_tokens = sum(batch.input_ids.numel() for batch in method_calibration)
        forward_passes = counted[0] / (method_tokens * results["num_layers"])  # passes of its own calibration set
        row = {"method": spec, "recipe": result.recipe.model_dump(mode="json"),
               "removed_blocks": result.manifest["removed_blocks"], "compress_seconds": seconds,
               "compress_passes": seconds / pass_seconds, "parameters": count_parameters(model),
               "forward_passes": forward_passes, "calibration": method_calibration.description}
        if not args.no_perplexity:
            row["perplexity"] = measure(model, texts, spec)
        if tasks:
            row["accuracy"] = accuracy(model, loaded.tokenizer, tasks, args.limit, dtype)
            row["relative_performance"] = relative_performance(row["accuracy"], results["original"]["accuracy"])
        for key in ("compensation", "collapsed", "patch", "replacement", "refit"):  # what the method did, beside the figures
            if result.manifest.get(key):
                row[key] = result.manifest[key]
        row["selection_score"] = result.manifest["selection"].get("score")
        if result.manifest["selection"].get("span_count_search"):  # --spans auto: every count's model and loss
            row["span_count_search"] = result.manifest["selection"]["span_count_search"]
        results["rows"].append(row)
        print(json.dumps({k: row.get(k) for k in ("method", "removed_blocks", "compress_passes", "forward_passes",
                                                  "perplexity")}
                         | ({"rp": row["relative_performance"]["average"]} if tasks else {})), flush=True)
        write_json(args.json, results)


if __name__ == "__main__":
    main()
