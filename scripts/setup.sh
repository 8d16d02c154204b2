#!/usr/bin/env bash
# Creates .venv and installs dmuon with CPU torch 2.13.0. Usage: scripts/setup.sh [extras]
# DMUON_PYTHON: the interpreter the venv is made from (default python3; CI's other legs set it).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
    "${DMUON_PYTHON:-python3}" -m venv .venv
fi
stamp=".venv/.dmuon-installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    # torch first in the same resolve: the pinned CPU wheel, never a multi-GB CUDA build.
    .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".${extras:+[$extras]}"
    if [ "$extras" = test ]; then
        # the torchtitan integration tests: torchtitan without its training-data dependencies
        .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "torchtitan==0.3.0"
    fi
    touch "$stamp"
fi
