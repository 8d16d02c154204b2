"""Scenario 2: random single-byte flips and truncations anywhere in a checkpoint.

Every one must be detected by ``verify`` and by ``load``, with an error naming the damaged
file; a load may never succeed with wrong values.
"""
import os
import random
import shutil

import pytest
import torch

import dmuon
import dmuon.dcp as ddcp
from dmuon.dcp.checkpoint import open_checkpoint
from tests.helpers.launch import run_ranks
from tests.helpers.tamper import as_version_3
from tests.helpers.training import build, train

FLIPS, TRUNCATIONS = 200, 20


def save_worker(rank, world, path):
    model, opt = build()
    train(model, opt, rank, world, range(2))
    ddcp.save(model, opt, path, extra={"step": 2, "note": "pristine"})


def damage(path, rng, kind):
    files = sorted(os.listdir(path))  # data files, manifest and .metadata alike
    victim = rng.choice(files)
    raw = bytearray((path / victim).read_bytes())
    if kind == "flip":
        where = rng.randrange(len(raw))
        raw[where] ^= rng.randrange(1, 256)
    else:
        raw = raw[: rng.randrange(len(raw))]
    (path / victim).write_bytes(bytes(raw))
    return victim


def corruption_worker(rank, world, pristine, scratch, seed):
    """One rank loads everything: each trial's damage lies in a file this rank reads."""
    from pathlib import Path

    rng = random.Random(seed)
    model, opt = build()
    ddcp.load(model, opt, pristine)
    good = dmuon.get_model_state_dict(model)
    counts = {"trials": 0, "verify_detected": 0, "load_detected": 0, "named_file": 0,
              "silent_wrong": 0, "silent_right": 0}
    misses = []
    for trial in range(FLIPS + TRUNCATIONS):
        kind = "flip" if trial < FLIPS else "truncate"
        work = Path(scratch) / f"t{trial}"
        shutil.copytree(pristine, work)
        victim = damage(work, rng, kind)
        counts["trials"] += 1
        try:
            problems = open_checkpoint(str(work)).verify_files()
            verify_msg = "\n".join(problems)
        except ddcp.CheckpointError as exc:
            verify_msg = str(exc)
        if verify_msg:
            counts["verify_detected"] += 1
        fresh, fresh_opt = build()
        try:
            ddcp.load(fresh, fresh_opt, str(work))
            loaded = dmuon.get_model_state_dict(fresh)
            same = all(torch.equal(loaded[k], good[k]) for k in good)
            counts["silent_right" if same else "silent_wrong"] += 1
            misses.append((trial, kind, victim))
        except ddcp.CheckpointError as exc:
            counts["load_detected"] += 1
            if victim in str(exc) or (victim == ".metadata" and "metadata" in str(exc)):
                counts["named_file"] += 1
            else:
                misses.append((trial, kind, victim, str(exc)[:200]))
        shutil.rmtree(work)
    return {"counts": counts, "misses": misses}


def test_every_flip_and_truncation_is_detected_and_named(tmp_path, reliability_report):
    pristine = tmp_path / "pristine"
    run_ranks(save_worker, 2, str(pristine))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    res = run_ranks(corruption_worker, 1, str(pristine), str(scratch), 1234, timeout=600)[0]
    counts = res["counts"]
    reliability_report["corruption"] = counts
    assert counts["trials"] == FLIPS + TRUNCATIONS
    assert counts["silent_wrong"] == 0, res["misses"]
    assert counts["verify_detected"] == counts["trials"], res["misses"]
    assert counts["load_detected"] == counts["trials"], res["misses"]
    assert counts["named_file"] == counts["trials"], res["misses"]


def _manifest_name(path):
    return next(f for f in os.listdir(path) if f.startswith(".dmuon-manifest-"))


def _edit_manifest(path, edit):
    """Change the manifest's file entries and re-sign it, as a forger would."""
    from dmuon.dcp.format.manifest import decode_manifest, encode_manifest

    name = _manifest_name(path)
    manifest = decode_manifest(name, (path / name).read_bytes())
    edit(manifest.files)
    (path / name).write_bytes(encode_manifest(manifest))


def _write_v1_manifest(path, wrong_whole_file_for=None):
    # (from a checkpoint of version 3: tests.helpers.tamper.as_version_3)
    """Replace the manifest by what dmuon 0.1's first releases wrote: version 1, zlib CRC-32 per
    item and a whole-file CRC-32 per data file."""
    import json
    import zlib

    from dmuon.dcp.format.manifest import decode_manifest

    name = _manifest_name(path)
    current = decode_manifest(name, (path / name).read_bytes())
    files = {}
    for file, stats in current.files.items():
        data = (path / file).read_bytes()
        items = {str(o): [it.length, zlib.crc32(data[o:o + it.length])] for o, it in stats.items.items()}
        whole = zlib.crc32(data) ^ (1 if file == wrong_whole_file_for else 0)
        files[file] = {"size": stats.size, "crc32": whole, "items": items}
    metadata = (path / ".metadata").read_bytes()
    body = {"format": "dmuon-manifest/1", "save_id": current.save_id, "files": files,
            "metadata": {"size": len(metadata), "crc32": zlib.crc32(metadata)}}
    line = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    (path / name).write_bytes(line + f"\ncrc32={zlib.crc32(line):08x}\n".encode())


def test_verify_checks_version_1_manifests_and_item_coverage(tmp_path):
    path = tmp_path / "ckpt"
    run_ranks(save_worker, 2, str(path))
    assert open_checkpoint(str(path)).verify_files() == []
    victim = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]

    as_version_3(path)  # (dmuon's checkpoints before checksum trailers)
    _write_v1_manifest(path)  # the earlier format: right values verify clean
    listing = open_checkpoint(str(path))
    assert listing.manifest.version == "dmuon-manifest/1" and listing.verify_files() == []
    _write_v1_manifest(path, wrong_whole_file_for=victim)  # its whole-file CRC is checked too
    problems = open_checkpoint(str(path)).verify_files()
    assert len(problems) == 1 and problems[0].startswith(f"{victim}: checksum mismatch"), problems

    def drop_an_item(files):
        items = files[victim].items
        del items[sorted(items)[1]]

    _edit_manifest(path, drop_an_item)  # bytes no CRC covers are refused, not skipped
    with pytest.raises(ddcp.CheckpointCorruptError, match=f"in {victim} does not match the manifest"):
        open_checkpoint(str(path)).verify_files()
