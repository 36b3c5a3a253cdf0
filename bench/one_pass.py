"""Issue #46: what one default ``compress`` costs, in units of one plain forward pass of its calibration
set, measured in one process: a plain forward of every calibration batch through the model (no hooks,
no statistics; timed after a warm-up, before and after the compress, and averaged), then the compress
of a copy with hooks counting the token positions every decoder block runs (block forwards, in passes
of the calibration set through every block: machine-independent), beside what ``--dry-run`` plans for it.

    .venv/bin/python bench/one_pass.py --model smollm2-135m --blocks 8 --json out.json
    .venv/bin/python bench/one_pass.py --methods all --num-seqs 4 --seq-len 128 --no-timing --json counts.json

``--methods all`` is every registered method with its defaults; ``--no-timing`` counts block forwards
only (exact on any machine, and on a few short sequences, which is all a count needs).

Run it once per code version (``PYTHONPATH=<checkout>/src``) to compare versions: each run's ratio is
its own, so the machine's speed cancels; the block-forward counts are exact.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
import time
from pathlib import Path

import torch

import blockfold
from blockfold.api import provenance
from blockfold.data import build_calibration
from blockfold.jsonfile import write_json
from blockfold.plan import plan_for
from blockfold.recipe import CalibrationConfig, Recipe
from blockfold.runtime import Execution
from blockfold.settings import SETTINGS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from defaults_validation import CALIBRATION_DOCUMENTS, DATA  # noqa: E402
from new_methods import count_block_tokens, parse_method  # noqa: E402


@torch.no_grad()
def plain_forward_seconds(model, calibration) -> float:
    """Seconds for one forward of every calibration batch through ``model`` as transformers runs it."""
    started = time.perf_counter()
    for batch in calibration:
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--methods", default="replaceme",
                        help="method specs as in bench/new_methods.py; all: every registered method's defaults")
    parser.add_argument("--num-seqs", type=int, default=64, help="calibration sequences (the recipe: 64)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence (the recipe: 512)")
    parser.add_argument("--no-timing", action="store_true", help="count block forwards only, no plain forward timed")
    parser.add_argument("--chunk-sequences", default="auto",
                        help="sequences per forward of the compress, comma-separated to compare (auto: blockfold's choice)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    specs = [name for spec in args.methods.split(",") for name in (SETTINGS if spec == "all" else [spec])]
    loaded = blockfold.load_model(args.model)
    calibration_config = CalibrationConfig(source=str(DATA / "c4_demo.jsonl"), max_documents=CALIBRATION_DOCUMENTS,
                                           num_sequences=args.num_seqs, sequence_length=args.seq_len)
    calibration = build_calibration(calibration_config, loaded.tokenizer)
    tokens = sum(batch.input_ids.numel() for batch in calibration)
    num_layers = loaded.model.config.num_hidden_layers
    plain_forward_seconds(loaded.model, list(calibration)[:1])  # warm-up
    results = {"provenance": provenance(["bench/one_pass.py", *sys.argv[1:]]), "model": args.model,
               "blocks": args.blocks, "calibration": calibration.description, "rows": []}
    chunks = [None if size == "auto" else int(size) for size in args.chunk_sequences.split(",")]
    for spec, chunk in itertools.product(specs, chunks):
        method, settings = parse_method(spec)
        budget = {"attention_layers": args.blocks} if "attention_layers" in SETTINGS[method].model_fields else \
            {"blocks": args.blocks}
        recipe = Recipe.parse({"method": method, **budget, **settings, "calibration": calibration_config.model_dump()})
        planned = plan_for(args.model, recipe, Execution()).numbers.get("forward_passes")
        before = None if args.no_timing else plain_forward_seconds(loaded.model, calibration)
        model = copy.deepcopy(loaded.model)
        counted = count_block_tokens(model)
        started = time.perf_counter()
        result = blockfold.compress(model, loaded.tokenizer, recipe, calibration=calibration,
                                    execution=Execution(chunk_sequences=chunk))
        seconds = time.perf_counter() - started
        after = None if args.no_timing else plain_forward_seconds(loaded.model, calibration)
        row = {"method": spec, "chunk_sequences": chunk, "removed_blocks": result.manifest["removed_blocks"], "compress_seconds": seconds,
               "plain_forward_seconds": None if args.no_timing else [before, after],
               "compress_in_plain_forwards": None if args.no_timing else seconds / ((before + after) / 2),
               "block_forwards": counted[0] / (tokens * num_layers), "planned_block_forwards": planned,
               "passes": result.manifest["execution"]["passes"],
               "refit_original_streams": (result.manifest.get("refit") or {}).get("original_streams"),
               "weights": {name: float(value.double().abs().sum()) for name, value in model.state_dict().items()}}
        results["rows"].append(row)
        print({key: row[key] for key in ("method", "chunk_sequences", "removed_blocks", "compress_in_plain_forwards", "block_forwards",
                                         "passes")}, flush=True)
        write_json(args.json, results)


if __name__ == "__main__":
    main()
