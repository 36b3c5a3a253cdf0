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
# the default set: one worker per core, each test file on one worker (the composition matrix shares its
# plain runs and its one torchrun spawn within a file)
exec .venv/bin/python -m pytest -n auto --dist loadfile "$@"
