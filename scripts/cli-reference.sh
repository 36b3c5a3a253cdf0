#!/usr/bin/env bash
# Regenerate docs/cli.md from the command-line parser (tests/test_registry.py fails when it is stale).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -c "from blockfold.cli import reference_markdown; print(reference_markdown(), end='')" > docs/cli.md
