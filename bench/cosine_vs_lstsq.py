"""Why the cosine objective can lose to least squares: per-token diagnostics of each fitted map.

    .venv/bin/python bench/cosine_vs_lstsq.py --span-start 11 --blocks 8

On a token subsample (and a held-out subsample), for plain removal, lstsq and cosine fits with
several L-BFGS budgets: mean cosine distance to the residual after the span, relative squared
error, and how well the predicted residual's norm matches the target's; then WikiText-2
perplexity of each folded model. One calibration pass serves all fits.
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
from blockfold.estimate import fit_lstsq, fit_numerically
from blockfold.eval import perplexity, read_eval_text, tokenize_windows
from blockfold.jsonfile import write_json
from blockfold.pipelines import run_observers
from blockfold.recipe import CalibrationConfig
from blockfold.settings import CosineConfig
from blockfold.stats import SpanSample, SpanStatistics
from blockfold.surgery import fold_into_down_proj, remove_blocks

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))


def diagnostics(rows, transform) -> dict:
    prediction = rows.attn_residual.double() + rows.x.double() @ transform
    target = rows.target.double()
    cosine = torch.nn.functional.cosine_similarity(prediction, target, dim=-1)
    norm_ratio = prediction.norm(dim=-1) / target.norm(dim=-1)
    y = target - rows.attn_residual.double()
    heavy = target.norm(dim=-1) > target.norm(dim=-1).quantile(0.99)
    return {"mean_cosine_distance": float((1 - cosine).mean()),
            "relative_squared_error": float(((prediction - target) ** 2).sum() / (y**2).sum()),
            "median_norm_ratio": float(norm_ratio.median()),
            "norm_ratio_top1pct_tokens": float(norm_ratio[heavy].median()),
            "cosine_distance_top1pct_tokens": float((1 - cosine[heavy]).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--span-start", type=int, default=11)
    parser.add_argument("--steps", default="10,30,60")
    parser.add_argument("--ppl-windows", type=int, default=40)
    parser.add_argument("--json", default="bench/results/cosine_vs_lstsq.json")
    args = parser.parse_args()
    started = provenance(["bench/cosine_vs_lstsq.py", *sys.argv[1:]])

    loaded = blockfold.load_model(args.model)
    adapter = get_adapter(loaded.model)
    calibration = build_calibration(CalibrationConfig(source=str(DATA / "c4_demo.jsonl"), max_documents=128), loaded.tokenizer)
    windows = tokenize_windows(read_eval_text(DATA / "wikitext2_test.txt"), loaded.tokenizer, 512, args.ppl_windows)
    start, length = args.span_start, args.blocks
    statistics = SpanStatistics(adapter.num_layers(loaded.model), 0, length, starts=[start])
    train = SpanSample(start, length, 16384, calibration.num_tokens, pre_norm=False, seed=0)
    held_out = SpanSample(start, length, 8192, calibration.num_tokens, pre_norm=False, seed=1)
    run_observers(loaded, calibration, [statistics, train, held_out])
    equations = statistics.finalize().normal_equations[start]
    train_rows, held_rows = train.rows(), held_out.rows()

    lstsq, _ = fit_lstsq(equations)
    fits = {"plain removal": torch.eye(lstsq.shape[0], dtype=torch.float64), "lstsq": lstsq}
    for steps in map(int, args.steps.split(",")):
        fits[f"cosine ({steps} L-BFGS iterations)"], _ = fit_numerically(train_rows, lstsq, CosineConfig(steps=steps), "cosine")
    results = {}
    for label, transform in fits.items():
        model = copy.deepcopy(loaded.model)
        fold_into_down_proj(adapter.down_proj(adapter.layers(model)[start - 1]), transform)
        remove_blocks(model, adapter, list(range(start, start + length)))
        results[label] = {"train": diagnostics(train_rows, transform), "held_out": diagnostics(held_rows, transform),
                          "perplexity": perplexity(model, windows)["perplexity"]}
        print(label, json.dumps(results[label]))
        del model
    write_json(args.json, {**results, "provenance": started}, indent=2)
    print("\n| map | cosine dist. (held-out) | rel. sq. error (held-out) | norm ratio, median | norm ratio, top-1% tokens | ppl |")
    print("|---|---|---|---|---|---|")
    for label, r in results.items():
        h = r["held_out"]
        print(f"| {label} | {h['mean_cosine_distance']:.4f} | {h['relative_squared_error']:.4f} | "
              f"{h['median_norm_ratio']:.3f} | {h['norm_ratio_top1pct_tokens']:.3f} | {r['perplexity']:.2f} |")


if __name__ == "__main__":
    main()
