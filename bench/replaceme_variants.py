"""ReplaceMe variants on one model and budget (issue #5): WikiText-2 perplexity of each.

    .venv/bin/python bench/replaceme_variants.py --groups criteria,estimators,spans,calibration,healing

Groups (each row: what was removed and the perplexity after):

* ``criteria``: one calibration pass; the span each selection criterion picks, fitted with lstsq;
* ``estimators``: the same pass; each estimator on the span the default criterion picks;
* ``spans``: 1 span vs ``--spans`` spans vs greedy one-block-at-a-time (``blockfold.compress``);
* ``calibration``: the default recipe calibrated on c4_demo, alpaca_en_demo (chat template),
  self-generated text, and a 50/50 mix of c4_demo and alpaca;
* ``healing``: the default 1-span model healed for ``--heal-steps`` steps, LT-only vs LoRA.

Calibration defaults to the common recipe (the first 128 documents of c4_demo, 64 × 512 tokens);
perplexity to the first 40 windows of 512 tokens of WikiText-2, float32.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import blockfold
from blockfold.api import as_handle, provenance
from blockfold.data import build_calibration
from blockfold.estimate import fit_span_map
from blockfold.eval import perplexity, read_eval_text, tokenize_windows
from blockfold.healing import heal
from blockfold.jsonfile import write_json
from blockfold.methods import Job, PassCache
from blockfold.methods.replaceme import measure_spans
from blockfold.pipelines import Runner
from blockfold.recipe import CalibrationConfig, HealConfig, Recipe
from blockfold.select import SPAN_CRITERIA, best_span, span_criteria
from blockfold.settings import ReplaceMe

DEFAULT_CRITERION = ReplaceMe.model_fields["criterion"].default
DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))
ESTIMATORS = ["identity", "lstsq", "diagonal", "orthogonal", "lowrank", "cosine", "cosine+l1"]


def _estimator_recipe(name: str, blocks: int, start: int, l1: float) -> Recipe:
    if name == "cosine+l1":
        return Recipe(blocks=blocks, span_start=start, estimator="cosine", cosine={"l1_penalty": l1})
    return Recipe(blocks=blocks, span_start=start, estimator=name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--groups", default="criteria,estimators,spans,calibration,healing")
    parser.add_argument("--spans", default="2", help="span counts to compare with 1 span, comma-separated")
    parser.add_argument("--calib", default=str(DATA / "c4_demo.jsonl"))
    parser.add_argument("--calib-docs", type=int, default=128)
    parser.add_argument("--instruct", default=str(DATA / "alpaca_en_demo.json"))
    parser.add_argument("--estimators", default=",".join(ESTIMATORS), help="rows of the estimators group")
    parser.add_argument("--l1", default="0.0001", help="L1 penalties of the cosine+l1 rows, comma-separated")
    parser.add_argument("--heal-data", default=str(DATA / "c4_demo.jsonl"))
    parser.add_argument("--heal-steps", type=int, default=100)
    parser.add_argument("--ppl", default=str(DATA / "wikitext2_test.txt"))
    parser.add_argument("--ppl-windows", type=int, default=40)
    parser.add_argument("--json", default="bench/results/replaceme_variants.json")
    args = parser.parse_args()
    started = provenance(["bench/replaceme_variants.py", *sys.argv[1:]])

    loaded = blockfold.load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    windows = tokenize_windows(read_eval_text(args.ppl), tokenizer, 512, args.ppl_windows)
    c4 = CalibrationConfig(source=args.calib, max_documents=args.calib_docs)
    calibration = build_calibration(c4, tokenizer)
    path = Path(args.json)
    results = json.loads(path.read_text()) if path.is_file() else {}
    results.update({"model": args.model, "blocks": args.blocks, "default_calibration": calibration.description,
                    "ppl_windows": args.ppl_windows, "default_criterion": DEFAULT_CRITERION})
    results.setdefault("provenance", []).append(started)  # one entry per invocation merged into this file
    if "original" not in results:
        results["original"] = perplexity(model, windows, description="original")["perplexity"]
    n = args.blocks

    def record(group: str, name: str, candidate, manifest: dict, seconds: float) -> None:
        ppl = perplexity(candidate, windows, description=f"{group}: {name}")["perplexity"]
        spans = manifest.get("spans") or []
        row = {"removed_blocks": manifest["removed_blocks"], "perplexity": ppl, "seconds": seconds,
               "spans": [s["blocks"] for s in spans],
               "relative_fit_error": [s["transform"].get("relative_fit_error") for s in spans]}
        results.setdefault(group, {})[name] = row
        print(f"{group:12} {name:28} removed {row['removed_blocks']} ppl {ppl:.2f}", flush=True)
        write_json(path, results, indent=2)

    groups = args.groups.split(",")
    if {"criteria", "estimators"} & set(groups):
        cache = PassCache()  # one calibration pass serves every criterion's choice and every row
        handle = as_handle(model, tokenizer, None)
        job = Job(handle, ReplaceMe(blocks=n), calibration, Runner(handle), cache)
        measured = measure_spans(job, [n], n, DEFAULT_CRITERION, all_criteria=True)
        scores = span_criteria(measured.distances, measured.tables, measured.moments,
                               lambda eq: fit_span_map(eq, "lstsq", warn=False)[0])
        choices = {name: best_span(scores[name], n, name).start for name in SPAN_CRITERIA}
        results["criteria_choices"] = choices

        def replaced(recipe: Recipe) -> tuple:
            candidate = copy.deepcopy(model)
            started = time.perf_counter()
            result = blockfold.compress(candidate, tokenizer, recipe, calibration=calibration, cache=cache)
            return candidate, result.manifest, time.perf_counter() - started

        if "criteria" in groups:
            for name in SPAN_CRITERIA:
                record("criteria", name, *replaced(Recipe(blocks=n, span_start=choices[name])))
        if "estimators" in groups:
            start = choices[DEFAULT_CRITERION]
            for name in args.estimators.split(","):
                for l1 in ([float(x) for x in args.l1.split(",")] if name == "cosine+l1" else [0.0]):
                    label = f"{name} (λ={l1:g})" if name == "cosine+l1" else name
                    record("estimators", label, *replaced(_estimator_recipe(name, n, start, l1)))

    def compressed(group: str, name: str, recipe: dict, calib=calibration) -> None:
        candidate = copy.deepcopy(model)
        started = time.perf_counter()
        result = blockfold.compress(candidate, tokenizer, Recipe.parse({"blocks": n, **recipe}), calibration=calib)
        record(group, name, candidate, result.manifest, time.perf_counter() - started)
        results[group][name]["calibration"] = copy.deepcopy(result.manifest["calibration"])

    if "spans" in groups:
        compressed("spans", "1 span", {})
        for count in args.spans.split(","):
            compressed("spans", f"{count} spans", {"spans": int(count)})
        compressed("spans", "greedy (1 block per round)", {"greedy": True})
    if "calibration" in groups:
        instruct = CalibrationConfig(source=args.instruct)
        mix = CalibrationConfig(source=f"{args.calib}:0.5,{args.instruct}:0.5", max_documents=args.calib_docs)
        for name, config in (("c4_demo", None), ("alpaca_en_demo (chat template)", instruct),
                             ("self-generated", CalibrationConfig(source=None)), ("c4_demo 50% + alpaca 50%", mix)):
            calib = calibration if config is None else build_calibration(config, tokenizer, model)
            compressed("calibration", name, {"calibration": config.model_dump() if config else c4.model_dump()}, calib)
    if "healing" in groups:
        heal_data = build_calibration(HealConfig().data.model_copy(update={"source": args.heal_data}), tokenizer)
        base = copy.deepcopy(model)
        result = blockfold.compress(base, tokenizer, Recipe(blocks=n), calibration=calibration)
        for mode in ("lt", "lora"):
            candidate, manifest = copy.deepcopy(base), copy.deepcopy(result.manifest)
            started = time.perf_counter()
            candidate = heal(candidate, heal_data, HealConfig(mode=mode, steps=args.heal_steps), manifest)
            record("healing", mode, candidate, manifest, time.perf_counter() - started)
            results["healing"][mode]["healing"] = manifest["healing"]
        write_json(path, results, indent=2)


if __name__ == "__main__":
    main()
