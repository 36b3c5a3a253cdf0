"""Folding a span's linear map into a sandwich-norm block (Gemma-3-270m), compared in one run.

    .venv/bin/python bench/gemma_sandwich.py --blocks 4 [--placement]

The span is the one compress selects with today's defaults. Rows: the original; plain removal of
that span; the closed-form map applied *after* the post-feedforward norm as an extra module (the
ideal linear fit, which no stock checkpoint can hold); and the two foldable forms blockfold chooses
between (docs/gemma.md). ``--placement`` adds every start of the same length through compress (the
sandwich fold included) and each criterion's rank correlation with the perplexity reached: how well
the post-norm proxy the criteria score ranks the spans the real fold replaces.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch

import blockfold
from blockfold.adapters import get_adapter
from blockfold.api import provenance
from blockfold.data import build_calibration
from blockfold.estimate import fit_lstsq
from blockfold.eval import perplexity, read_eval_text, tokenize_windows
from blockfold.jsonfile import write_json
from blockfold.pipelines import run_observers
from blockfold.recipe import CalibrationConfig, Recipe
from blockfold.stats import SpanStatistics
from blockfold.surgery import remove_blocks

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))


class _AfterNorm(torch.nn.Module):
    def __init__(self, norm, transform):
        super().__init__()
        self.norm, self.transform = norm, transform.float()

    def forward(self, x):
        return self.norm(x) @ self.transform


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--calib", default=str(DATA / "c4_demo.jsonl"))
    parser.add_argument("--ppl", default=str(DATA / "wikitext2_test.txt"))
    parser.add_argument("--ppl-windows", type=int, default=40)
    parser.add_argument("--placement", action="store_true", help="also every start of the same length (slow)")
    parser.add_argument("--placement-windows", type=int, default=20,
                        help="perplexity windows per start in the placement study (the first of --ppl's)")
    parser.add_argument("--json", default="bench/results/gemma_sandwich.json")
    args = parser.parse_args()
    started = provenance(["bench/gemma_sandwich.py", *sys.argv[1:]])

    loaded = blockfold.load_model(args.model)
    adapter = get_adapter(loaded.model)
    config = CalibrationConfig(source=args.calib, max_documents=128)
    calibration = build_calibration(config, loaded.tokenizer)
    windows = tokenize_windows(read_eval_text(args.ppl), loaded.tokenizer, 512, args.ppl_windows)
    rows = {"original": perplexity(loaded.model, windows)["perplexity"]}

    # the span compress selects with today's defaults, and its post-norm normal equations
    num_layers = adapter.num_layers(loaded.model)
    default = blockfold.compress(copy.deepcopy(loaded.model), loaded.tokenizer, Recipe(blocks=args.blocks, calibration=config),
                                 calibration=calibration)
    blocks = default.manifest["removed_blocks"]
    start = blocks[0]
    statistics = SpanStatistics(num_layers, 0, args.blocks, starts=[start])
    run_observers(loaded, calibration, [statistics])
    transform, info = fit_lstsq(statistics.finalize().normal_equations[start])
    # the ideal (unfoldable) map: explicit module after the post-feedforward norm
    model = copy.deepcopy(loaded.model)
    layer = adapter.layers(model)[start - 1]
    setattr(layer, adapter.post_mlp_norm, _AfterNorm(adapter.mlp_norm(layer), transform))
    remove_blocks(model, adapter, blocks)
    rows["explicit map after the norm (not a stock checkpoint)"] = perplexity(model, windows)["perplexity"]
    errors = {"explicit map after the norm (not a stock checkpoint)": info["relative_fit_error"]}
    del model

    for label, recipe in [
        ("plain removal", Recipe(blocks=args.blocks, span_start=start, estimator="identity", calibration=config)),
        ("folded: through-norm", Recipe(blocks=args.blocks, span_start=start, sandwich_fold="through-norm", calibration=config)),
        ("folded: linearized-norm", Recipe(blocks=args.blocks, span_start=start, sandwich_fold="linearized-norm",
                                           calibration=config)),
    ]:
        model = copy.deepcopy(loaded.model)
        result = blockfold.compress(model, loaded.tokenizer, recipe, calibration=calibration)
        rows[label] = perplexity(model, windows)["perplexity"]
        errors[label] = result.manifest["transform"]["relative_fit_error"]
        print(label, rows[label], json.dumps(result.manifest["transform"].get("sample_loss_per_regime")))
        del model
    out = {"model": args.model, "removed_blocks": blocks, "selection": {k: default.manifest["selection"].get(k) for k in
                                                                        ("criterion", "scored_map", "score")},
           "auto_regime": default.manifest["transform"]["regime"], "perplexity": rows, "relative_fit_error": errors,
           "recipe": default.recipe.model_dump(mode="json"), "calibration": calibration.description,
           "ppl_windows": args.ppl_windows, "provenance": started}
    write_json(args.json, out, indent=2)  # the table, before the long placement study
    if args.placement:
        from blockfold.sweep import placement_study

        out["placement"] = placement_study(loaded, calibration, args.blocks, windows[:args.placement_windows])
        out["placement"]["ppl_windows"] = min(args.placement_windows, len(windows))
        write_json(args.json, out, indent=2)
    print(f"\nremoved blocks {blocks[0]}-{blocks[-1]} of {num_layers}\n")
    print("| variant | relative fit error | WikiText-2 ppl |\n|---|---|---|")
    for label, ppl in rows.items():
        error = errors.get(label)
        print(f"| {label} | {'-' if error is None else f'{error:.4f}'} | {ppl:.2f} |")


if __name__ == "__main__":
    main()
