#!/usr/bin/env bash
# Quantize a float model to W4A16 (compressed-tensors, as llm-compressor writes it):
#
#   scripts/quantize-w4a16.sh MODEL OUT [--method gptq|rtn] [--group-size 64] [--corpus FILE]
#
# MODEL: a float Hugging Face folder or a built-in name (smollm2-135m). llm-compressor gets its own virtual
# environment on first use (it pins transformers <= 5.17), in ${BLOCKFOLD_ENGINES:-.engines}/llmcompressor.
# GPTQ on SmolLM2-135M takes about 25 minutes on 2 CPU cores; round to nearest, seconds.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
[ $# -ge 2 ] || { sed -n 2,8p "$0" >&2; exit 2; }
home="$(realpath -m "${BLOCKFOLD_ENGINES:-$repo/.engines}")/llmcompressor"
[ -x "$repo/.venv/bin/python" ] || (cd "$repo" && bash scripts/setup.sh)
if [ ! -f "$home/.ready" ]; then
  rm -rf "$home"
  python3 -m venv "$home"
  "$home/bin/pip" install -q torch==2.13.0
  "$home/bin/pip" install -q llmcompressor==0.14.0.1
  touch "$home/.ready"
fi
model="$("$repo/.venv/bin/python" -c 'import sys; from blockfold.models.sources import resolve_model_path; print(resolve_model_path(sys.argv[1]))' "$1")"
shift
exec "$home/bin/python" "$repo/scripts/quantize_w4a16.py" "$model" "$@"
