"""Issue #44's comparison as the papers make it: every depth method with its best setting beside the three
width methods, at the same shares of the blocks' parameters, as one resumable ``blockfold sweep`` per model:
held-out perplexity (WikiText-2 windows 40-59, C4 documents the calibration never reads, LAMBADA), harness
accuracy with RP, prefill and decode speed-ups, compress time and peak memory.

    .venv/bin/python bench/width_comparison.py --model smollm2-135m            # 10, 20, 25 and 35 %
    .venv/bin/python bench/width_comparison.py --model gemma3-270m             # 20 and 25 %
    .venv/bin/python bench/width_comparison.py --model smollm2-135m --print     # the command, not run

A sweep stopped part way (a session's end) resumes from ``.<out>.resume`` when started again. Each depth
method runs with the setting its rows in BENCHMARKS.md found best: the baselines with blockfold's refit stage
after them, SLEB scoring on 2 of the recipe's sequences (its refit fits on all). NBL and DROP-attention reach
only the share of the blocks their attention holds; the sweep skips, with the reason, what they cannot reach.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from blockfold.cli import DATA_DIR, main as blockfold

SPARSITIES = {"smollm2-135m": "0.1,0.2,0.25,0.35", "gemma3-270m": "0.2,0.25"}
METHODS = ("replaceme,uidl:refit=all,drop-block:refit=all,prune-comp:refit=all,sleb:score_sequences=2;refit=all,"
           "laco,linear-patch,streamline,nbl,nbl-block,drop-attn,svd-llm,slicegpt,llm-pruner")
TASKS = "piqa,arc_easy,hellaswag,lambada_openai"


def command(model: str, out: str, limit: int, methods: str, eval_dtype: str) -> list[str]:
    return ["sweep", "--model", model, "--methods", methods, "--sparsity", SPARSITIES[model], "--eval-dtype", eval_dtype,
            "--calib", str(DATA_DIR / "c4_demo.jsonl"), "--calib-docs", "128", "--num-seqs", "64", "--seq-len", "512",
            "--ppl", f"{DATA_DIR / 'wikitext2_test.txt'}[40:60]",
            "--held-out", f"{DATA_DIR / 'c4_demo.jsonl'}[200:],{DATA_DIR / 'lambada_test.jsonl'}",
            "--ppl-windows", "20", "--tasks", TASKS, "--limit", str(limit), "--no-analysis", "--out", out]


def run() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SPARSITIES), default="smollm2-135m")
    parser.add_argument("--out", help="the sweep's folder (default: bench/runs/width-MODEL)")
    parser.add_argument("--limit", type=int, default=200, help="questions per task")
    parser.add_argument("--methods", default=METHODS, help="the sweep's rows (default: every method at its best)")
    parser.add_argument("--eval-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="what every model is measured in (bfloat16: about twice as fast on CPUs with AVX512-BF16)")
    parser.add_argument("--print", action="store_true", help="print the blockfold command instead of running it")
    args = parser.parse_args()
    argv = command(args.model, args.out or f"bench/runs/width-{args.model}", args.limit, args.methods, args.eval_dtype)
    if args.print:
        print(".venv/bin/blockfold " + " ".join(shlex.quote(part) for part in argv))
        return 0
    return blockfold(argv)


if __name__ == "__main__":
    sys.exit(run())
