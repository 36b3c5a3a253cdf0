#!/usr/bin/env bash
# Set up (if needed) and run the test suite. `--slow` adds the long real-model tests CI runs;
# `--extended` adds those and the real-model figures of non-default variants too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
case "${1:-}" in
  --slow) shift; exec .venv/bin/python -m pytest -m "not extended" "$@" ;;
  --extended) shift; exec .venv/bin/python -m pytest -m "extended or not extended" "$@" ;;
esac
exec .venv/bin/python -m pytest "$@"
