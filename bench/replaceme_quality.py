"""ReplaceMe quality on a real model: WikiText-2 perplexity of the original, of plain removal of
a span, and of each estimator, all from one calibration set in one run.

    .venv/bin/python bench/replaceme_quality.py --model smollm2-135m --blocks 8 --span-start 11

Defaults reproduce issue #2's recipe: the first 128 documents of c4_demo joined by blank lines
(recipe version 2's packing; ``--packing 3`` for today's), cut into 512-token sequences, the first
64 kept; perplexity on the first 40 non-overlapping 512-token windows of the WikiText-2 test text,
float32. ``@selected`` runs choose the span with today's default criterion.
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
from blockfold.api import provenance
from blockfold.data import build_calibration
from blockfold.eval import perplexity, read_eval_text, tokenize_windows
from blockfold.jsonfile import write_json
from blockfold.recipe import CalibrationConfig, Recipe

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--span-start", type=int, default=11, help="the fixed span to compare estimators on")
    parser.add_argument("--calib", default=str(DATA / "c4_demo.jsonl"))
    parser.add_argument("--calib-docs", type=int, default=128)
    parser.add_argument("--ppl", default=str(DATA / "wikitext2_test.txt"))
    parser.add_argument("--ppl-windows", type=int, default=40)
    parser.add_argument("--packing", choices=["2", "3"], default="2",
                        help="2: blank lines between documents, the start on the first sequence only (issue #2's "
                             "recipe); 3: today's (EOS between documents, every sequence starts as a text)")
    parser.add_argument("--runs", default="identity@fixed,lstsq@fixed,cosine@fixed,lstsq@selected,cosine@selected")
    parser.add_argument("--json", default="bench/results/replaceme_quality.json")
    args = parser.parse_args()
    started = provenance(["bench/replaceme_quality.py", *sys.argv[1:]])

    loaded = blockfold.load_model(args.model)
    packing = {"document_separator": "blank-line", "start_every_sequence": False} if args.packing == "2" else {}
    calibration_config = CalibrationConfig(source=args.calib, max_documents=args.calib_docs, **packing)
    calibration = build_calibration(calibration_config, loaded.tokenizer)
    windows = tokenize_windows(read_eval_text(args.ppl), loaded.tokenizer, 512, args.ppl_windows)
    results = {"model": args.model, "blocks": args.blocks, "calibration": calibration.description,
               "original": perplexity(loaded.model, windows)["perplexity"], "packing": int(args.packing), "runs": [], "provenance": started}
    print(f"original ppl {results['original']:.2f}")
    for run in args.runs.split(","):
        estimator, where = run.split("@")
        recipe = Recipe(blocks=args.blocks, estimator=estimator, calibration=calibration_config,
                        span_start=args.span_start if where == "fixed" else None)
        model = copy.deepcopy(loaded.model)
        started = time.perf_counter()
        result = blockfold.compress(model, loaded.tokenizer, recipe, calibration=calibration)
        seconds = time.perf_counter() - started
        ppl = perplexity(model, windows)["perplexity"]
        entry = {"run": run, "estimator": estimator, "removed_blocks": result.manifest["removed_blocks"],
                 "perplexity": ppl, "relative_fit_error": result.manifest["transform"]["relative_fit_error"],
                 "numerical_fit": result.manifest["transform"].get("numerical_fit"), "compress_seconds": seconds,
                 "recipe": result.recipe.model_dump(mode="json")}
        results["runs"].append(entry)
        print(json.dumps(entry))
        del model
    write_json(args.json, results, indent=2)
    print(f"\n| run | removed blocks | WikiText-2 ppl | relative fit error |\n|---|---|---|---|\n| original | - | {results['original']:.2f} | - |")
    for e in results["runs"]:
        print(f"| {e['run']} | {e['removed_blocks'][0]}-{e['removed_blocks'][-1]} | {e['perplexity']:.2f} | {e['relative_fit_error']:.4f} |")


if __name__ == "__main__":
    main()
