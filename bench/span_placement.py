"""Placement study: with the span length fixed, every admissible start, every selection criterion's
value for it, and the perplexity the folded model reaches. Answers "does the criterion pick the best
span?" with each criterion's rank correlation to perplexity and the perplexity of its choice.

    .venv/bin/python bench/span_placement.py --model smollm2-135m --blocks 8

One calibration pass computes every criterion (``SpanStatistics`` + ``StreamSimilarity``); each
start then costs a fold and a perplexity evaluation. ``--estimators`` adds rows per estimator
(``lstsq_stream``: least squares with every token weighted by 1/‖h‖², from the same pass).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import numpy as np

import blockfold
from blockfold.adapters import get_adapter
from blockfold.data import build_calibration
from blockfold.estimate import fit_span_map, solve_normal_equations
from blockfold.eval import perplexity, read_eval_text, tokenize_windows
from blockfold.recipe import CalibrationConfig
from blockfold.select import SPAN_CRITERIA, span_criteria
from blockfold.pipelines import run_observers
from blockfold.stats import SpanStatistics
from blockfold.stats.similarity import StreamSimilarity
from blockfold.surgery import fold_into_down_proj, remove_blocks
from blockfold.sweep import spearman

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--calib", default=str(DATA / "c4_demo.jsonl"))
    parser.add_argument("--calib-docs", type=int, default=128)
    parser.add_argument("--ppl", default=str(DATA / "wikitext2_test.txt"))
    parser.add_argument("--ppl-windows", type=int, default=20)
    parser.add_argument("--estimators", default="lstsq", help="comma list: lstsq, lstsq_stream, identity, diagonal, ...")
    parser.add_argument("--json", default="bench/results/span_placement.json")
    args = parser.parse_args()

    loaded = blockfold.load_model(args.model)
    model, adapter = loaded.model, get_adapter(loaded.model)
    num_layers, n = adapter.num_layers(model), args.blocks
    calibration = build_calibration(CalibrationConfig(source=args.calib, max_documents=args.calib_docs), loaded.tokenizer)
    windows = tokenize_windows(read_eval_text(args.ppl), loaded.tokenizer, 512, args.ppl_windows)
    statistics, similarity = SpanStatistics(num_layers, n, n), StreamSimilarity(num_layers, [n])
    started = time.perf_counter()
    run_observers(loaded, calibration, [statistics, similarity])
    pass_seconds = time.perf_counter() - started
    table = statistics.finalize()
    scores = span_criteria(table, similarity.finalize(), lambda eq: fit_span_map(eq, "lstsq", warn=False)[0])
    starts = sorted(table.normal_equations)
    results = {"model": args.model, "blocks": n, "calibration": calibration.description, "pass_seconds": pass_seconds,
               "ppl_windows": args.ppl_windows, "original": perplexity(model, windows)["perplexity"],
               "criteria": {name: {s: float(scores[name][s, n]) for s in starts} for name in SPAN_CRITERIA},
               "perplexity": {}}
    for estimator in args.estimators.split(","):
        results["perplexity"][estimator] = {}
        for start in starts:
            if estimator == "lstsq_stream":
                weighted = table.stream_weighted_equations[start]
                transform = solve_normal_equations(weighted.xtx, weighted.xty, warn=False)[0]
            else:
                transform = fit_span_map(table.normal_equations[start], estimator, warn=False)[0]
            candidate = copy.deepcopy(model)
            fold_into_down_proj(adapter.down_proj(adapter.layers(candidate)[start - 1]), transform)
            remove_blocks(candidate, adapter, list(range(start, start + n)))
            ppl = perplexity(candidate, windows, description=f"{estimator} @ {start}")["perplexity"]
            results["perplexity"][estimator][start] = ppl
            print(f"{estimator} start {start}: ppl {ppl:.2f}", flush=True)
            del candidate
    for estimator, ppls in results["perplexity"].items():
        log_ppl = [np.log(ppls[s]) for s in starts]
        best = min(starts, key=ppls.__getitem__)
        print(f"\n{estimator}: best start {best} (ppl {ppls[best]:.2f})")
        print("| criterion | chosen start | ppl of its choice | Spearman ρ with log ppl |\n|---|---|---|---|")
        for name in SPAN_CRITERIA:
            values = [results["criteria"][name][s] for s in starts]
            choice = starts[int(np.argmin(values))]
            rho = spearman(values, log_ppl)
            results.setdefault("summary", {}).setdefault(estimator, {})[name] = {
                "choice": choice, "ppl": ppls[choice], "spearman": float(rho)}
            print(f"| {name} | {choice} | {ppls[choice]:.2f} | {rho:.3f} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
