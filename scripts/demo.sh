#!/usr/bin/env bash
# Set up (if needed), then the main job on the built-in default model: compress SmolLM2-135M by
# removing 8 of its 30 blocks with ReplaceMe, evaluate it against the original (WikiText-2
# perplexity, two harness tasks with relative performance, size, speed, CO2eq), keep the checkpoint,
# and write an HTML + Markdown report. Paths to data are configurable through BLOCKFOLD_DATA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
DATA=${BLOCKFOLD_DATA:-../shared/data}
OUT=${OUT:-out/demo}
.venv/bin/blockfold sweep --model "${MODEL:-smollm2-135m}" --methods replaceme --blocks "${BLOCKS:-8}" \
  --calib "$DATA/c4_demo.jsonl" --calib-docs 128 --ppl "$DATA/wikitext2_test.txt" --ppl-windows "${PPL_WINDOWS:-40}" \
  --tasks "${TASKS:-piqa,arc_easy}" --limit "${LIMIT:-100}" --save-models --out "$OUT" --overwrite "$@"
.venv/bin/blockfold report "$OUT"
echo "compressed checkpoint: $OUT/models/replaceme-${BLOCKS:-8} (loads with AutoModelForCausalLM.from_pretrained)"
