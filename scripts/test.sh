#!/usr/bin/env bash
# Installs dmuon with its test extras (local S3 and GCS servers included) and Ceph RGW, then
# runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
bash scripts/install-ceph.sh  # Ceph RGW for the S3 tests (Debian packages)
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false  # gcsfs stalls on emulators without it
exec .venv/bin/python -m pytest -q "$@"
