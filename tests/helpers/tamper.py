"""Rewriting a committed checkpoint's ``.metadata`` the way an attacker (or another Python) would:
with a checksum manifest that vouches for the new bytes, so only the loader's own checks stand."""

from __future__ import annotations

import os
from pathlib import Path

from dmuon.dcp.format.checksums import checksum_of
from dmuon.dcp.format.layout import METADATA, is_manifest_name
from dmuon.dcp.format.manifest import decode_manifest, encode_manifest


def manifest_of(path: Path):
    name = next(f for f in os.listdir(path) if is_manifest_name(f))
    return name, decode_manifest(name, (path / name).read_bytes())


def rewrite(path: Path, metadata_bytes: bytes, files=None) -> None:
    """Install new .metadata bytes with a manifest that vouches for them. The manifest's
    sharding index, which dmuon's loads read instead of ``.metadata``, goes (a manifest without
    one is valid): the loads then read the bytes installed here (hostile indexes have tests of
    their own)."""
    name, manifest = manifest_of(path)
    (path / METADATA).write_bytes(metadata_bytes)
    manifest.files = files or manifest.files
    manifest.index = None
    manifest.metadata_size = len(metadata_bytes)
    manifest.metadata_checksum = checksum_of(manifest.checksum, metadata_bytes)
    (path / name).write_bytes(encode_manifest(manifest))


def as_version_3(path: Path):
    """Turn a checkpoint written with checksum trailers (manifest version 4) into what dmuon
    wrote before them: each data file cut at its trailer, every item's checksums in the
    manifest (version 3). For tests that edit or forge per-item checksums; returns
    ``(manifest file name, manifest)`` as written."""
    from dmuon.dcp.checkpoint import open_checkpoint
    from dmuon.dcp.format.manifest import FileStats

    listing = open_checkpoint(str(path))
    name, manifest = manifest_of(path)
    for file, stats in manifest.files.items():
        if stats.sums_at is None:
            continue
        items = dict(listing.file_items(file))
        os.truncate(path / file, stats.sums_at)
        manifest.files[file] = FileStats(stats.sums_at, items)
    (path / name).write_bytes(encode_manifest(manifest))
    return manifest_of(path)
