"""Placement study: with the span length fixed, every admissible start, every selection criterion's
value for it, and the perplexity of the model ``compress --span-start`` builds there. Answers "does the
criterion pick the best span?" with each criterion's rank correlation to perplexity and the
perplexity of its choice.

    .venv/bin/python bench/span_placement.py --model smollm2-135m --blocks 8

The same study as ``blockfold sweep --placement`` (``blockfold.sweep.placement_study``): one
calibration pass scores every criterion, then each start costs a compress from the cached pass and a
perplexity evaluation. On sandwich-norm blocks (Gemma) each start gets the fold compress chooses.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import blockfold
from blockfold.api import provenance
from blockfold.data import build_calibration
from blockfold.eval import read_eval_text, tokenize_windows
from blockfold.jsonfile import write_json
from blockfold.recipe import CalibrationConfig
from blockfold.sweep import placement_study

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--calib", default=str(DATA / "c4_demo.jsonl"))
    parser.add_argument("--calib-docs", type=int, default=128)
    parser.add_argument("--ppl", default=str(DATA / "wikitext2_test.txt"))
    parser.add_argument("--ppl-windows", type=int, default=20)
    parser.add_argument("--json", default="bench/results/span_placement.json")
    args = parser.parse_args()
    started = provenance(["bench/span_placement.py", *sys.argv[1:]])

    loaded = blockfold.load_model(args.model)
    config = CalibrationConfig(source=args.calib, max_documents=args.calib_docs)
    calibration = build_calibration(config, loaded.tokenizer)
    windows = tokenize_windows(read_eval_text(args.ppl), loaded.tokenizer, 512, args.ppl_windows)
    study = placement_study(loaded, calibration, args.blocks, windows)
    results = {"model": args.model, "calibration": calibration.description, "calibration_config": config.model_dump(mode="json"),
               "ppl_windows": args.ppl_windows, **study, "provenance": started}
    write_json(args.json, results, indent=2)
    print(f"best start {study['best']['start']} (ppl {study['best']['perplexity']:.2f})")
    print("| criterion | chosen start | ppl of its choice | Spearman ρ with log ppl |\n|---|---|---|---|")
    for name, summary in study["criteria"].items():
        print(f"| {name} | {summary['choice']} | {summary['choice_perplexity']:.2f} | {summary['spearman_with_log_ppl']:.3f} |")


if __name__ == "__main__":
    main()
