#!/usr/bin/env bash
# Set up (if needed), then the main job on the built-in default model: compress SmolLM2-135M by
# removing 8 of its 30 blocks with ReplaceMe, evaluate it against the original (WikiText-2
# perplexity, two harness tasks with relative performance, size, speed, CO2eq), keep the checkpoint,
# and write an HTML + Markdown report. Quick by default (a few minutes on 2 cores: 32 calibration
# sequences, 20 perplexity windows, 50 questions per task); `--full` uses the figures' sizes (64
# sequences, 40 windows, 100 questions). Paths to data are configurable through BLOCKFOLD_DATA.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=(--num-seqs 32 --ppl-windows 20 --limit 50)
if [ "${1:-}" = "--full" ]; then
  shift
  SIZE=(--num-seqs 64 --ppl-windows 40 --limit 100)
fi
bash scripts/setup.sh
DATA=${BLOCKFOLD_DATA:-../shared/data}
OUT=${OUT:-out/demo}
.venv/bin/blockfold sweep --model "${MODEL:-smollm2-135m}" --methods replaceme --budgets "${BLOCKS:-8}" \
  --calib "$DATA/c4_demo.jsonl" --calib-docs 128 --ppl "$DATA/wikitext2_test.txt" \
  --tasks "${TASKS:-piqa,arc_easy}" "${SIZE[@]}" --save-models --out "$OUT" --overwrite "$@"
