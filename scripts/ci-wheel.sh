#!/usr/bin/env bash
# CI: dmuon as a user installs it. Builds the sdist and the wheel from a clone of HEAD
# (python -m build), checks them (twine check --strict), installs the wheel into a fresh venv
# beside CPU torch 2.13.0 and runs it from a directory outside any source tree: dmuon-ckpt
# --help, the demo (2 ranks: checkpoints, a crash, a resume that must end bit-identical, an
# export), then dmuon-ckpt verify and inspect on the demo's last checkpoint. A module or file
# missing from the wheel, or a broken entry point, fails here.
# Usage: scripts/ci-wheel.sh [prepare|run]
#   prepare  build, check and install (downloads and unpacking: .ci/run does it in the
#            background while the main suite runs, as it does the other legs' venvs)
#   run      run the installed wheel (preparing it first if it is not), then remove it
#   (neither: run, which prepares as it goes)
# The prepared build lives in DMUON_LEGS_DIR/wheel (default /tmp/dmuon-ci-legs/wheel), marked
# with the commit it was built from: one from another commit is built again.
# DMUON_PYTHON: the interpreter (default python3). DMUON_KEEP_DIST=DIR: copy the sdist and wheel there.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
python=${DMUON_PYTHON:-python3}
mode=run
case "${1:-}" in prepare|run) mode=$1 ;; esac
work="${DMUON_LEGS_DIR:-/tmp/dmuon-ci-legs}/wheel"
[ "$mode" = prepare ] || trap 'rm -rf "$work"' EXIT
pip_quiet=(-m pip install -q --disable-pip-version-check)
head=$(git rev-parse HEAD)

if [ "$(cat "$work/.prepared" 2>/dev/null)" != "$head" ]; then
    rm -rf "$work"
    mkdir -p "$work"
    git clone -q "$repo" "$work/src"  # what is committed is what is packaged
    "$python" -m venv "$work/build-venv"
    "$work/build-venv/bin/python" "${pip_quiet[@]}" build twine
    "$work/build-venv/bin/python" -m build --outdir "$work/dist" "$work/src" >"$work/build.log" 2>&1 \
        || { cat "$work/build.log" >&2; exit 1; }
    "$work/build-venv/bin/twine" check --strict "$work/dist"/*
    "$python" -m venv "$work/venv"
    "$work/venv/bin/python" "${pip_quiet[@]}" "torch==2.13.0" "$work/dist"/dmuon-*.whl
    echo "$head" >"$work/.prepared"
fi
[ "$mode" = run ] || exit 0
[ -z "${DMUON_KEEP_DIST:-}" ] || { mkdir -p "$DMUON_KEEP_DIST"; cp "$work/dist"/* "$DMUON_KEEP_DIST"/; }

mkdir "$work/run"
cd "$work/run"
unset PYTHONPATH
where=$("$work/venv/bin/python" -c "import dmuon, dmuon.dcp; print(dmuon.__file__)")
case "$where" in
    "$work/venv/"*) echo "ci-wheel: dmuon $("$work/venv/bin/python" -c "import dmuon; print(dmuon.__version__)") from $where" ;;
    *) echo "ci-wheel: dmuon imported from $where, not from the installed wheel" >&2; exit 1 ;;
esac
"$work/venv/bin/dmuon-ckpt" --help >/dev/null
"$work/venv/bin/python" -m dmuon.demo --steps 8 --save-every 4 --crash-at 6 --checkpoint-dir "$work/run/checkpoints"
last=$(ls -d "$work/run/checkpoints"/run-*/step-8)
"$work/venv/bin/dmuon-ckpt" verify "$last"
"$work/venv/bin/dmuon-ckpt" inspect "$last" >/dev/null
echo "ci-wheel: OK"
