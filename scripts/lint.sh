#!/usr/bin/env bash
# Lint, format check and type check of the library (dmuon/); part of scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check dmuon
.venv/bin/ruff format --check dmuon
.venv/bin/mypy
