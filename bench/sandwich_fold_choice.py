"""Does ``--sandwich-fold auto`` choose the better fold? Both folds at every start, on Gemma-3-270m.

    .venv/bin/python bench/sandwich_fold_choice.py --model gemma3-270m --blocks 4 --ppl-windows 12

For each start of a span of ``--blocks`` blocks, compress builds the model with each fold
(``--sandwich-fold compare``, which fits both and records their losses on the token sample the
through-norm map was refitted on and on held-out calibration tokens, then the other fold forced),
and its perplexity is measured; a fold whose fit is not finite is recorded as failed. The question
is which comparison picks the fold with the lower perplexity, and what the choice costs when it
does not. Calibration and perplexity text as in the Gemma section.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import blockfold
from blockfold.api import provenance
from blockfold.data import build_calibration
from blockfold.errors import BlockfoldError
from blockfold.eval import perplexity, read_eval_text, tokenize_windows
from blockfold.jsonfile import write_json
from blockfold.methods import PassCache
from blockfold.recipe import CalibrationConfig, Recipe

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))
FOLDS = ("linearized-norm", "through-norm")


def _pick(losses: dict[str, float]) -> str:
    finite = {fold: loss for fold, loss in losses.items() if math.isfinite(loss)}
    return min(finite, key=finite.get)


def summarize(rows: list[dict]) -> dict:
    """For each way of comparing the folds: how often it picks the fold with the lower perplexity,
    and the geometric-mean perplexity ratio of its picks to the better fold's."""
    summary = {}
    for rule, key in (("objective on the fit sample (version 3's auto)", "sample_loss"),
                      ("objective on held-out tokens (compare)", "held_out_loss"),
                      ("cosine distance on held-out tokens", "held_out_cosine"),
                      ("linearized-norm unless its fit is not finite (version 4's auto)", None)):
        if key is None:
            picks = [FOLDS[0] if math.isfinite(row["sample_loss"][FOLDS[0]]) else FOLDS[1] for row in rows]
        else:
            picks = [_pick(row[key]) for row in rows]
        right = sum(pick == row["better"] for pick, row in zip(picks, rows))
        ratios = [row["perplexity"].get(pick, math.inf) / row["perplexity"][row["better"]] for pick, row in zip(picks, rows)]
        summary[rule] = {"right": right, "of": len(rows),
                         "geomean_ppl_ratio_to_better": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                         "worst_ppl_ratio_to_better": max(ratios)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--starts", default="", help="comma-separated starts (default: every admissible start)")
    parser.add_argument("--calib", default=str(DATA / "c4_demo.jsonl"))
    parser.add_argument("--calib-docs", type=int, default=128)
    parser.add_argument("--ppl", default=str(DATA / "wikitext2_test.txt"))
    parser.add_argument("--ppl-windows", type=int, default=12)
    parser.add_argument("--json", default="bench/results/sandwich_fold_choice.json")
    parser.add_argument("--summarize-only", action="store_true",
                        help="recompute the summary of --json's measured rows (after a rule is added), measuring nothing")
    args = parser.parse_args()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    started = provenance(["bench/sandwich_fold_choice.py", *sys.argv[1:]])
    if args.summarize_only:
        out = json.loads(Path(args.json).read_text())
        out.update(summary=summarize(out["rows"]), summary_provenance=started)
        write_json(args.json, out, indent=2)
        print(json.dumps(out["summary"], indent=2))
        return

    handle = blockfold.open_model(args.model)
    config = CalibrationConfig(source=args.calib, max_documents=args.calib_docs)
    calibration = build_calibration(config, handle.tokenizer)
    windows = tokenize_windows(read_eval_text(args.ppl), handle.tokenizer, 512, args.ppl_windows)
    num_layers = handle.adapter.num_layers(handle.model)
    starts = [int(s) for s in args.starts.split(",") if s] or list(range(1, num_layers - args.blocks + 1))
    cache = PassCache()
    rows = []
    for start in starts:
        row = {"start": start, "perplexity": {}}
        # compare fits both folds and records their losses; the other fold is then forced
        for fold in ("compare", "other"):
            if fold == "other":
                fold = next((f for f in FOLDS if f not in row["perplexity"] and f not in row["failed"]), None)
                if fold is None:  # the fold compare did not build failed
                    break
            recipe = Recipe(blocks=args.blocks, span_start=start, sandwich_fold=fold, calibration=config)
            try:
                compressed = blockfold.compress(handle.fresh_copy(), recipe=recipe, calibration=calibration, cache=cache)
            except BlockfoldError as err:  # a forced fold whose fit is not finite: compare and auto skip it
                row.setdefault("failed", {})[fold] = str(err)
                continue
            fit = compressed.manifest["transform"]
            built = fit["regime"]
            row["perplexity"][built] = perplexity(compressed.model, windows, description=f"{start} {built}")["perplexity"]
            if fold == "compare":
                row.update(sample_loss=fit["sample_loss_per_regime"], held_out_loss=fit["held_out_loss_per_regime"],
                           held_out_cosine=fit["held_out_cosine_distance_per_regime"], compared_on=fit["compared_on"])
                row["failed"] = {f: "fit not finite" for f in FOLDS if not math.isfinite(fit["sample_loss_per_regime"][f])}
            row.setdefault("recipes", {})[built] = compressed.recipe.model_dump(mode="json")
            del compressed
        row["better"] = min(row["perplexity"], key=row["perplexity"].get)  # a failed fold has no perplexity
        rows.append(row)
        print(start, json.dumps({k: row[k] for k in ("perplexity", "sample_loss", "held_out_loss", "held_out_cosine")}),
              flush=True)
        write_json(args.json, {"rows": rows, "partial": True}, indent=2)  # survives a stopped run
    out = {"model": args.model, "blocks": args.blocks, "calibration": calibration.description,
           "ppl_windows": args.ppl_windows, "rows": rows, "summary": summarize(rows), "provenance": started}
    write_json(args.json, out, indent=2)
    print(json.dumps(out["summary"], indent=2))


if __name__ == "__main__":
    main()
