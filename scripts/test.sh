#!/usr/bin/env bash
# Installs dmuon with its test extras (local S3 and GCS servers included) and Ceph RGW, runs
# ruff and mypy over dmuon/ (scripts/lint.sh), then the suite. Without root (or passwordless
# sudo) Ceph cannot be installed: its cases are then skipped, said once here and in pytest's
# summary. DMUON_REQUIRE_ALL_STORES=1 (set by .ci/run) makes a missing store an error instead.
set -euo pipefail
cd "$(dirname "$0")/.."
# Ceph's packages (apt) install while setup.sh installs the Python ones (pip): both mostly wait
# on downloads and the disk, and one after the other they added up their times.
bash scripts/install-ceph.sh &
ceph=$!
bash scripts/setup.sh test || { code=$?; wait "$ceph" || true; exit "$code"; }
status=0
wait "$ceph" || status=$?
if [ "$status" = 3 ] && [ "${DMUON_REQUIRE_ALL_STORES:-0}" != 1 ]; then
    echo "Ceph RGW is not installed (apt-get needs root): its S3 cases are skipped. Run as root, or with passwordless sudo, to include them."
elif [ "$status" != 0 ]; then
    exit "$status"
fi
# The lint and type check read the code, not the interpreter: CI's other-Python legs skip them
# (DMUON_SKIP_LINT=1); a stub that differs there would fail a leg over nothing it tests.
[ "${DMUON_SKIP_LINT:-0}" = 1 ] || bash scripts/lint.sh
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false  # gcsfs stalls on emulators without it
exec .venv/bin/python -m pytest -q --durations=25 "$@"  # (the slowest, to keep CI within its time)
