#!/usr/bin/env bash
# Installs Ceph's RADOS Gateway, monitor and OSD from Debian's packages: the tests run the S3
# scenarios against a one-node Ceph cluster as well as SeaweedFS. Nothing is started here;
# tests/helpers/object_storage.py starts the daemons and stops them by PID.
set -euo pipefail
needed=(radosgw ceph-mon ceph-osd)
if command -v radosgw >/dev/null && command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null; then
    exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
    if ! command -v sudo >/dev/null || ! sudo -n true 2>/dev/null; then
        echo "install-ceph: need root or passwordless sudo to apt-get ${needed[*]}" >&2
        exit 3  # scripts/test.sh: not installable here (as opposed to a failed install)
    fi
    sudo="sudo -n"
fi
export DEBIAN_FRONTEND=noninteractive
echo "installing ${needed[*]} from Debian (about 30 s)"
if ! $sudo apt-get install -y -qq --no-install-recommends "${needed[@]}" >/tmp/dmuon-install-ceph.log 2>&1; then
    # A fresh machine may have no package lists yet.
    $sudo apt-get update -qq >>/tmp/dmuon-install-ceph.log 2>&1
    $sudo apt-get install -y -qq --no-install-recommends "${needed[@]}" >>/tmp/dmuon-install-ceph.log 2>&1 \
        || { tail -30 /tmp/dmuon-install-ceph.log >&2; exit 1; }
fi
