"""Folding a span's linear map into a sandwich-norm block (Gemma-3-270m), compared in one run.

    .venv/bin/python bench/gemma_sandwich.py --blocks 4

Rows: the original; plain removal of the selected span; the closed-form map applied *after* the
post-feedforward norm as an extra module (the ideal linear fit, which no stock checkpoint can
hold); and the two foldable forms blockfold chooses between (docs/gemma.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import torch

import blockfold
from blockfold.adapters import get_adapter
from blockfold.data import build_calibration
from blockfold.estimate import fit_lstsq
from blockfold.eval import perplexity, read_eval_text, tokenize_windows
from blockfold.recipe import CalibrationConfig, Recipe
from blockfold.select import best_span
from blockfold.stats import SpanStatistics, stream_activations
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
    parser.add_argument("--json", default="bench/results/gemma_sandwich.json")
    args = parser.parse_args()

    loaded = blockfold.load_model(args.model)
    adapter = get_adapter(loaded.model)
    config = CalibrationConfig(source=args.calib, max_documents=128)
    calibration = build_calibration(config, loaded.tokenizer)
    windows = tokenize_windows(read_eval_text(args.ppl), loaded.tokenizer, 512, args.ppl_windows)
    rows = {"original": perplexity(loaded.model, windows)["perplexity"]}

    # the ideal (unfoldable) map: explicit module after the post-feedforward norm
    num_layers = adapter.num_layers(loaded.model)
    statistics = SpanStatistics(num_layers, args.blocks, args.blocks)
    stream_activations(loaded.model, adapter, calibration, [statistics])
    table = statistics.finalize()
    choice = best_span(table.criterion("angular_last"), args.blocks, "angular_last")
    transform, info = fit_lstsq(table.normal_equations[choice.start])
    model = copy.deepcopy(loaded.model)
    layer = adapter.layers(model)[choice.start - 1]
    setattr(layer, adapter.post_mlp_norm, _AfterNorm(adapter.mlp_norm(layer), transform))
    remove_blocks(model, adapter, choice.blocks)
    rows["explicit map after the norm (not a stock checkpoint)"] = perplexity(model, windows)["perplexity"]
    errors = {"explicit map after the norm (not a stock checkpoint)": info["relative_fit_error"]}
    del model

    for label, recipe in [
        ("plain removal", Recipe(blocks=args.blocks, estimator="identity", calibration=config)),
        ("folded: through-norm", Recipe(blocks=args.blocks, sandwich_fold="through-norm", calibration=config)),
        ("folded: linearized-norm", Recipe(blocks=args.blocks, sandwich_fold="linearized-norm", calibration=config)),
    ]:
        model = copy.deepcopy(loaded.model)
        result = blockfold.compress(model, loaded.tokenizer, recipe, calibration=calibration)
        rows[label] = perplexity(model, windows)["perplexity"]
        errors[label] = result.manifest["transform"]["relative_fit_error"]
        print(label, rows[label], json.dumps(result.manifest["transform"].get("sample_loss_per_regime")))
        del model
    out = {"model": args.model, "removed_blocks": choice.blocks, "perplexity": rows, "relative_fit_error": errors}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"\nremoved blocks {choice.blocks[0]}-{choice.blocks[-1]} of {num_layers}\n")
    print("| variant | relative fit error | WikiText-2 ppl |\n|---|---|---|")
    for label, ppl in rows.items():
        error = errors.get(label)
        print(f"| {label} | {'-' if error is None else f'{error:.4f}'} | {ppl:.2f} |")


if __name__ == "__main__":
    main()
