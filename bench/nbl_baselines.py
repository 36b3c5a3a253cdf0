"""NBL and the pruning baselines on a real model, in one run: WikiText-2 perplexity, parameter sparsity,
prefill speed-up, decode speed-up and KV-cache ratio for each method and budget.

    .venv/bin/python bench/nbl_baselines.py --model smollm2-135m

Attention methods (NBL ranked by CCA bound, by NMSE and by the stream-relative error; DROP-attn) at
k = 4, 8, 12 share one calibration
pass: the statistics are collected once and each configuration is applied to a fresh copy of the
model with the same functions ``--method nbl`` / ``drop-attn`` use. Block methods at 8 blocks
(replaceme lstsq, nbl-block, uidl, drop-block, sleb) each run ``blockfold.compress`` as the CLI does;
``method:criterion`` picks a ranking other than the method's default (``nbl-block:cca``). Every run
records the resolved recipe it ran (the attention rows: the recipe ``--method nbl`` would run).
Calibration is issue #2's recipe (c4_demo, 64 × 512 tokens), except SLEB, whose greedy search scores
every remaining block with the full model's loss at every step: it gets --sleb-sequences × 256 tokens.
Speed is measured against the original in the same process, interleaved, median of --repeats.
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
from blockfold.adapters import get_adapter
from blockfold.api import as_handle, provenance
from blockfold.data import build_calibration
from blockfold.eval import perplexity, read_eval_text, tokenize_windows
from blockfold.eval.speed import benchmark, parameter_counts
from blockfold.jsonfile import write_json
from blockfold.methods.nbl import all_scores, drop_attention, linearize
from blockfold.pipelines import run_observers
from blockfold.recipe import CalibrationConfig, Recipe
from blockfold.select import lowest_scoring
from blockfold.settings import NBL, DropAttention
from blockfold.stats import SublayerLinearity

#: the setting that names a block method's ranking, for ``method:criterion`` runs
CRITERION_FIELD = {"replaceme": "criterion", "uidl": "criterion", "nbl-block": "linearity_criterion"}

DATA = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data"))


def measure(name, model, original, windows, args, extra) -> dict:
    started = time.perf_counter()
    ppl = perplexity(model, windows, description=f"ppl {name}")["perplexity"]
    speed = benchmark({"original": original, "compressed": model}, lengths=(args.speed_length,),
                      decode_tokens=args.decode_tokens, repeats=args.repeats)
    base, new = speed["original"], speed["compressed"]
    length = args.speed_length
    entry = {
        "run": name, **extra, "perplexity": ppl,
        "sparsity": 1 - new["non_embedding_parameters"] / base["non_embedding_parameters"],
        "parameters": new["parameters"],
        f"prefill_speedup_{length}": new["prefill_tokens_per_s"][length] / base["prefill_tokens_per_s"][length],
        "decode_speedup": new["decode_tokens_per_s"] / base["decode_tokens_per_s"],
        "kv_cache_ratio": new["kv_cache_bytes"][length] / base["kv_cache_bytes"][length],
        "speed": speed, "measure_seconds": time.perf_counter() - started,
    }
    print(json.dumps({k: v for k, v in entry.items() if k != "speed"}), flush=True)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calib", default=str(DATA / "c4_demo.jsonl"))
    parser.add_argument("--calib-docs", type=int, default=128)
    parser.add_argument("--num-seqs", type=int, default=64, help="calibration sequences of 512 tokens")
    parser.add_argument("--ppl", default=str(DATA / "wikitext2_test.txt"))
    parser.add_argument("--ppl-windows", type=int, default=40)
    parser.add_argument("--attn", default="4,8,12", help="attention-layer budgets")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--attention-runs", default="nbl-cca,nbl-nmse,nbl-stream,nbl-cosine,drop-attn")
    parser.add_argument("--block-runs", default="replaceme,nbl-block,uidl,drop-block,sleb")
    parser.add_argument("--sleb-sequences", type=int, default=4)
    parser.add_argument("--speed-length", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="bench/results/nbl_baselines.json")
    args = parser.parse_args()
    started = provenance(["bench/nbl_baselines.py", *sys.argv[1:]])

    loaded = blockfold.load_model(args.model)
    original, tokenizer = loaded.model, loaded.tokenizer
    adapter = get_adapter(original)
    calibration_config = CalibrationConfig(source=args.calib, max_documents=args.calib_docs, num_sequences=args.num_seqs)
    calibration = build_calibration(calibration_config, tokenizer)
    windows = tokenize_windows(read_eval_text(args.ppl), tokenizer, 512, args.ppl_windows)
    results = {"model": args.model, "calibration": calibration.description, "ppl_windows": args.ppl_windows,
               "original": {"perplexity": perplexity(original, windows)["perplexity"], **parameter_counts(original)},
               "runs": [], "provenance": started}
    print(f"original ppl {results['original']['perplexity']:.2f}", flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        write_json(out, results, indent=2, default=str)

    runs = [r for r in args.attention_runs.split(",") if r]
    if runs:
        started = time.perf_counter()
        linearity = SublayerLinearity(adapter.num_layers(original), "attention")
        run_observers(original, calibration, [linearity])
        statistics = linearity.finalize()
        scores = all_scores(statistics)
        results["attention_statistics_seconds"] = time.perf_counter() - started
        results["attention_scores"] = scores
        for k in (int(x) for x in args.attn.split(",")):
            for run in runs:
                criterion = "cosine" if run == "drop-attn" else run.removeprefix("nbl-")
                layers = sorted(lowest_scoring(scores[criterion], k))
                settings = (DropAttention(attention_layers=k) if run == "drop-attn"
                            else NBL(attention_layers=k, linearity_criterion=criterion))
                model = copy.deepcopy(original)
                if run == "drop-attn":
                    drop_attention(as_handle(model, None, None), layers)
                else:
                    linearize(as_handle(model, None, None), statistics, layers, "attention")
                results["runs"].append(measure(f"{run} k={k}", model, original, windows, args,
                                               {"method": run, "k": k, "layers": layers,
                                                "recipe": Recipe.of(settings, calibration_config).model_dump(mode="json")}))
                save()
                del model

    for run in (r for r in args.block_runs.split(",") if r):
        method, _, criterion = run.partition(":")
        method_calibration = calibration
        config = calibration_config
        if method == "sleb":
            config = CalibrationConfig(source=args.calib, max_documents=args.calib_docs,
                                       num_sequences=args.sleb_sequences, sequence_length=256)
            method_calibration = build_calibration(config, tokenizer)
        ranking = {CRITERION_FIELD[method]: criterion} if criterion else {}
        recipe = Recipe(method=method, blocks=args.blocks, calibration=config, **ranking)
        model = copy.deepcopy(original)
        timer = time.perf_counter()
        result = blockfold.compress(model, tokenizer, recipe, calibration=method_calibration)
        seconds = time.perf_counter() - timer
        manifest = result.manifest
        layers = manifest["removed_blocks"] or manifest["replaced"]["layers"]
        results["runs"].append(measure(f"{run} {args.blocks} blocks", model, original, windows, args,
                                       {"method": run, "blocks": args.blocks, "layers": layers,
                                        "compress_seconds": seconds, "calibration_tokens": method_calibration.num_tokens,
                                        "recipe": result.recipe.model_dump(mode="json")}))
        save()
        del model

    save()
    length = args.speed_length
    print(f"\n| method | budget | layers | WikiText-2 ppl | sparsity | prefill speed-up @ {length} | decode speed-up | KV cache |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| original | - | - | {results['original']['perplexity']:.2f} | 0 | 1.00 | 1.00 | 1.000 |")
    for e in results["runs"]:
        budget = f"{e['k']} attn" if "k" in e else f"{e['blocks']} blocks"
        print(f"| {e['method']} | {budget} | {','.join(map(str, e['layers']))} | {e['perplexity']:.2f} | "
              f"{e['sparsity']:.3f} | {e[f'prefill_speedup_{length}']:.2f} | {e['decode_speedup']:.2f} | {e['kv_cache_ratio']:.3f} |")


if __name__ == "__main__":
    main()
