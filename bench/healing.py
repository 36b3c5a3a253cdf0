"""Cheap healing after compression: perplexity before and after ``heal`` (issue #12: on Gemma-3-270m,
whose linearized-norm fold plain training used to wreck).

    .venv/bin/python bench/healing.py --model gemma3-270m --blocks 4 --modes lt,lora --steps 100
    .venv/bin/python bench/healing.py --sandwich-fold through-norm --json bench/results/healing_through_norm.json

Compresses once with today's defaults (saved to a temporary folder), then heals that checkpoint in
each mode on c4_demo text and measures WikiText-2 perplexity (first 40 windows of 512 tokens)
before and after, as ``blockfold heal --ppl`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import blockfold
from blockfold.api import provenance
from blockfold.jsonfile import write_json

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--modes", default="lt,lora")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--sandwich-fold", default="auto", choices=["auto", "compare", "linearized-norm", "through-norm"],
                        help="Gemma: the fold (auto's linearized-norm is the one plain training used to wreck)")
    parser.add_argument("--ppl-windows", type=int, default=40)
    parser.add_argument("--json", default="bench/results/healing.json")
    args = parser.parse_args()
    started = provenance(["bench/healing.py", *sys.argv[1:]])
    text = DATA / "wikitext2_test.txt"
    recipe = blockfold.Recipe.of(blockfold.ReplaceMe(blocks=args.blocks, sandwich_fold=args.sandwich_fold),
                                 {"source": str(DATA / "c4_demo.jsonl"), "max_documents": 128})
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        compressed = blockfold.compress(args.model, recipe=recipe)
        folder = compressed.save(Path(tmp) / "compressed")
        transform = compressed.manifest["transform"]
        del compressed
        for mode in args.modes.split(","):
            healed = blockfold.heal(folder, {"mode": mode, "steps": args.steps,
                                             "data": {"source": str(DATA / "c4_demo.jsonl"), "num_sequences": 400,
                                                      "sequence_length": 256, "batch_size": 4}},
                                    perplexity_text=text, perplexity_windows=args.ppl_windows)
            record = healed.manifest["healing"]
            runs.append({"mode": mode, "before": record["perplexity"]["before"]["perplexity"],
                         "after": record["perplexity"]["after"]["perplexity"],
                         "loss_first_steps": record["loss_first_steps"], "loss_last_steps": record["loss_last_steps"],
                         "trained_parameters": record["trained_parameters"], "seconds": record["seconds"],
                         "linearized_down_proj_blocks": record.get("linearized_down_proj_blocks"),
                         "settings": {k: record[k] for k in ("steps", "learning_rate", "mode")}})
            print(json.dumps(runs[-1]), flush=True)
    write_json(args.json, {"model": args.model, "blocks": args.blocks, "regime": transform.get("regime"),
                          "recipe": recipe.model_dump(mode="json"), "runs": runs,
                          "provenance": started}, indent=1)


if __name__ == "__main__":
    main()
