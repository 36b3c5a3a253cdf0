"""What packing the calibration documents changes (issue #12): recipe version 3 (EOS after every
document, every sequence starting as a text does: Gemma's BOS on each) against version 2 (documents
joined by blank lines, the tokenizer's start on the first sequence only), with today's defaults.

    .venv/bin/python bench/calibration_packing.py            # SmolLM2-135M, 8 blocks; Gemma-3-270m, 4 blocks

Each row: the default ReplaceMe compress on the same 128 c4_demo documents (64 x 512 tokens), the
span it selects and the WikiText-2 perplexity of the result (first 40 windows of 512 tokens).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import blockfold
from blockfold.api import provenance
from blockfold.data import build_calibration
from blockfold.eval import perplexity, read_eval_text, tokenize_windows
from blockfold.jsonfile import write_json
from blockfold.recipe import CalibrationConfig, Recipe

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))
PACKINGS = {"version 3: EOS between documents, BOS on every sequence": {},
            "version 2: blank lines, start on the first sequence only": {"document_separator": "blank-line",
                                                                          "start_every_sequence": False}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m:8,gemma3-270m:4", help="model:blocks, comma-separated")
    parser.add_argument("--ppl-windows", type=int, default=40)
    parser.add_argument("--json", default="bench/results/calibration_packing.json")
    args = parser.parse_args()
    started = provenance(["bench/calibration_packing.py", *sys.argv[1:]])
    text = read_eval_text(DATA / "wikitext2_test.txt")
    rows = []
    for item in args.models.split(","):
        spec, blocks = item.rsplit(":", 1)
        loaded = blockfold.load_model(spec)
        windows = tokenize_windows(text, loaded.tokenizer, 512, args.ppl_windows)
        original = perplexity(loaded.model, windows, description=f"{spec} original")["perplexity"]
        for label, packing in PACKINGS.items():
            config = CalibrationConfig(source=str(DATA / "c4_demo.jsonl"), max_documents=128, **packing)
            recipe = Recipe(blocks=int(blocks), calibration=config)
            calibration = build_calibration(config, loaded.tokenizer)
            result = blockfold.compress(copy.deepcopy(loaded.model), loaded.tokenizer, recipe, calibration=calibration)
            ppl = perplexity(result.model, windows, description=f"{spec} {label[:9]}")["perplexity"]
            rows.append({"model": spec, "blocks": int(blocks), "packing": label, "original_perplexity": original,
                         "removed_blocks": result.manifest["removed_blocks"], "perplexity": ppl,
                         "relative_fit_error": result.manifest["transform"]["relative_fit_error"],
                         "calibration": calibration.description, "recipe": recipe.model_dump(mode="json")})
            print(json.dumps({k: rows[-1][k] for k in ("model", "packing", "removed_blocks", "perplexity")}), flush=True)
        del loaded
    write_json(args.json, {"rows": rows, "ppl_windows": args.ppl_windows, "provenance": started}, indent=1)


if __name__ == "__main__":
    main()
