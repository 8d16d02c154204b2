#!/usr/bin/env bash
# Creates .venv and installs dmuon with CPU torch 2.13.0. Usage: scripts/setup.sh [extras]
# DMUON_PYTHON: the interpreter the venv is made from (default python3; CI's other legs set it).
# DMUON_TORCH: the torch requirement installed with it (default torch==2.13.0; CI's torch-2.14.1
# leg sets torch==2.14.1).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
torch_spec="${DMUON_TORCH:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
    "${DMUON_PYTHON:-python3}" -m venv .venv
fi
stamp=".venv/.dmuon-installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$torch_spec" ]; then
    # torch first in the same resolve: the pinned wheel (2.13.0's CPU build by default), never a
    # newer torch that pip would otherwise pick (2.14.1 is a ~5.5 GB CUDA build: only on request).
    .venv/bin/python -m pip install -q --disable-pip-version-check "$torch_spec" -e ".${extras:+[$extras]}"
    # the torchtitan integration tests: torchtitan without its training-data dependencies; it
    # needs Python 3.11+ (CI's 3.10 leg runs the checkpoint tests, which do not use it)
    if [ "$extras" = test ] && .venv/bin/python -c "import sys; sys.exit(sys.version_info < (3, 11))"; then
        .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "torchtitan==0.3.0"
    fi
    echo "$torch_spec" > "$stamp"
fi
