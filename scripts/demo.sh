#!/usr/bin/env bash
# Set up (if needed), then the main job on the built-in default model: compress SmolLM2-135M by
# removing 8 of its 30 blocks with ReplaceMe, measure WikiText-2 perplexity before and after,
# and print the summary table. Paths to data are configurable through BLOCKFOLD_DATA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
DATA=${BLOCKFOLD_DATA:-../shared/data}
exec .venv/bin/blockfold compress --model "${MODEL:-smollm2-135m}" --calib "$DATA/c4_demo.jsonl" \
  --method replaceme --blocks "${BLOCKS:-8}" --estimator lstsq --out "${OUT:-out/smollm2-rm8}" --overwrite \
  --ppl "$DATA/wikitext2_test.txt" --ppl-windows "${PPL_WINDOWS:-40}" "$@"
