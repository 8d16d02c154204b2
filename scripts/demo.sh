#!/usr/bin/env bash
# Installs what the demo needs, then runs it: 2 CPU ranks, train, checkpoint, resume, export.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m dmuon.demo "$@"
