#!/usr/bin/env bash
# Set up (if needed) and run the test suite. `scripts/test.sh --slow` also runs the long real-model tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = "--slow" ]; then
  shift
  exec .venv/bin/python -m pytest -m "slow or not slow" "$@"
fi
exec .venv/bin/python -m pytest "$@"
