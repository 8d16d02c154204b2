"""Scenario 3: checkpoints crafted to attack the loader are refused; no code runs.

The attacker here rewrites the checksum manifest to match, so integrity checks pass and the
safety checks alone must hold.
"""
import io
import os
import pickle
import shutil
import zlib
from array import array

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

import dmuon.dcp as ddcp
from dmuon.dcp.checkpoint import open_checkpoint
from dmuon.dcp.format.checksums import checksum_of
from dmuon.dcp.format.layout import data_file_name
from dmuon.dcp.format.manifest import ItemChecksums, encode_manifest
from tests.helpers.launch import run_ranks
from tests.helpers.tamper import as_version_3, manifest_of, rewrite
from tests.helpers.training import build, train


def save_worker(rank, world, path):
    model, opt = build()
    train(model, opt, rank, world, range(1))
    ddcp.save(model, opt, path, extra={"step": 1, "note": "hello"})


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "ckpt"
    run_ranks(save_worker, 2, str(path))
    return path


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def load_worker(rank, world, path):
    model, opt = build()
    try:
        ddcp.load(model, opt, path)
        return None
    except ddcp.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"


def copy(pristine, tmp_path, name):
    target = tmp_path / name
    shutil.copytree(pristine, target)
    return target


def test_metadata_pickle_that_would_run_code(pristine, tmp_path, reliability_report):
    target = copy(pristine, tmp_path, "evil-metadata")
    marker = tmp_path / "PWNED"
    md = pickle.loads((pristine / ".metadata").read_bytes())
    md.planner_data["__dmuon__"]["payload"] = RunsCode(marker)
    rewrite(target, pickle.dumps(md))
    with pytest.raises(ddcp.UnsafeCheckpointError, match="posix.system|os.system|refusing to unpickle"):
        open_checkpoint(str(target))
    errors = run_ranks(load_worker, 2, str(target))
    assert all("UnsafeCheckpointError" in e for e in errors)
    assert not marker.exists()
    reliability_report.setdefault("hostile", {})["code_in_metadata"] = "refused, no code ran"


def forge_index(target, body_of) -> None:
    """Rewrite the manifest's sharding index as ``body_of(body)`` says (the manifest vouches)."""
    name, manifest = manifest_of(target)
    manifest.index = zlib.compress(pickle.dumps(body_of(pickle.loads(zlib.decompress(manifest.index)))))
    (target / name).write_bytes(encode_manifest(manifest))


def test_a_sharding_index_that_would_run_code(pristine, tmp_path, reliability_report):
    target = copy(pristine, tmp_path, "evil-index")
    marker = tmp_path / "PWNED-index"
    forge_index(target, lambda body: (body[0], RunsCode(marker), *body[2:]))
    errors = run_ranks(load_worker, 2, str(target))
    assert all(e is not None and e.startswith("UnsafeCheckpointError:") for e in errors), errors
    assert not marker.exists()
    reliability_report.setdefault("hostile", {})["code_in_sharding_index"] = "refused, no code ran"


@pytest.mark.parametrize("evil_path", ["../outside.distcp", "/etc/passwd"])
def test_a_sharding_index_naming_files_outside(pristine, tmp_path, evil_path):
    target = copy(pristine, tmp_path / "p", "evil-index-path")
    (tmp_path / "p" / "outside.distcp").write_bytes(b"secret")

    def outside(body):
        tag, skeleton, specs, name_form, *rest = body
        names = [data_file_name(r, name_form[1]) for r in array("q", name_form[2])]
        return tag, skeleton, specs, ("names", [evil_path] + names[1:]), *rest

    forge_index(target, outside)
    assert all("leaves the checkpoint directory" in e for e in run_ranks(load_worker, 2, str(target)))


def test_a_sharding_index_placing_items_past_a_file_end(pristine, tmp_path):
    target = copy(pristine, tmp_path, "evil-index-offsets")

    def past_the_end(body):
        columns = body[4]  # per class: its items' keys, gaps and lengths
        keys, gaps, lengths = columns[0]
        grown = array("q", lengths)
        grown[-1] += 10**9
        return (*body[:4], [(keys, gaps, grown.tobytes()), *columns[1:]], *body[5:])

    forge_index(target, past_the_end)
    assert all("CheckpointCorruptError" in e and "sharding index places items" in e
               for e in run_ranks(load_worker, 2, str(target)))


@pytest.mark.parametrize("evil_path", ["../outside.distcp", "/etc/passwd", "sub/dir.distcp", ".."])
def test_storage_paths_leaving_the_checkpoint(pristine, tmp_path, evil_path, reliability_report):
    target = copy(pristine, tmp_path / "p", "evil-path")
    (tmp_path / "p" / "outside.distcp").write_bytes(b"secret")
    md = pickle.loads((pristine / ".metadata").read_bytes())
    index, info = next(iter(md.storage_data.items()))
    md.storage_data[index] = _StorageInfo(evil_path, info.offset, info.length)
    rewrite(target, pickle.dumps(md))
    with pytest.raises(ddcp.UnsafeCheckpointError, match="leaves the checkpoint directory"):
        open_checkpoint(str(target))
    assert all("leaves the checkpoint directory" in e for e in run_ranks(load_worker, 2, str(target)))
    reliability_report.setdefault("hostile", {})[f"path {evil_path}"] = "refused"


@pytest.mark.parametrize("offset,length", [(-1, 10), (0, 10**12), (10**15, 4), (5, -3)])
def test_absurd_offsets_and_sizes(pristine, tmp_path, offset, length, reliability_report):
    target = copy(pristine, tmp_path, "absurd")
    md = pickle.loads((pristine / ".metadata").read_bytes())
    index, info = next(iter(md.storage_data.items()))
    md.storage_data[index] = _StorageInfo(info.relative_path, offset, length)
    rewrite(target, pickle.dumps(md))
    with pytest.raises(ddcp.CheckpointCorruptError, match="claims bytes"):
        open_checkpoint(str(target))
    reliability_report.setdefault("hostile", {})[f"offset {offset} length {length}"] = "refused"


def test_non_tensor_entry_that_unpickles_arbitrary_objects(pristine, tmp_path, reliability_report):
    """Replace the bytes of ``extra.note`` with a torch.save payload that would run code."""
    target = copy(pristine, tmp_path, "evil-bytes")
    marker = tmp_path / "PWNED-bytes"
    md = pickle.loads((pristine / ".metadata").read_bytes())
    index = next(i for i in md.storage_data if i.fqn == "extra.note")
    info = md.storage_data[index]
    payload = io.BytesIO()
    torch.save({"x": RunsCode(marker)}, payload)
    evil = payload.getvalue()
    # append the payload to the data file and point the entry at it; vouch for it in the manifest
    name, manifest = as_version_3(target)  # (checksums in the manifest, files without trailers)
    data_file = target / info.relative_path
    start = data_file.stat().st_size
    data_file.write_bytes(data_file.read_bytes() + evil)
    md.storage_data[index] = _StorageInfo(info.relative_path, start, len(evil))
    stats = manifest.files[info.relative_path]
    stats.size = start + len(evil)
    stats.items = {**stats.items, start: ItemChecksums.whole(len(evil), checksum_of(manifest.checksum, evil))}
    rewrite(target, pickle.dumps(md), manifest.files)
    errors = run_ranks(load_worker, 2, str(target))
    assert all((e and "weights_only" in e.lower()) or "unpickl" in (e or "").lower() for e in errors), errors
    assert not marker.exists()
    reliability_report.setdefault("hostile", {})["code_in_non_tensor_entry"] = "refused, no code ran"


class Getattr:
    """Pickles as ``getattr(owner, name)``: how Python 3.11.2 pickles an enum member."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return (getattr, (self.owner, self.name))


def _run_code_through_getattr(marker):
    """``getattr(builtins.__import__("os"), "system")("touch marker")`` as raw pickle opcodes."""
    return (
        b"\x80\x04cbuiltins\ngetattr\n(cbuiltins\n__import__\n(X\x02\x00\x00\x00ostRX\x06\x00\x00\x00systemtR"
        + b"(X" + len(f"touch {marker}").to_bytes(4, "little") + f"touch {marker}".encode() + b"tR."
    )


@pytest.mark.parametrize(
    "payload",
    [
        "os-system",
        Getattr(ddcp.DMuonLoadPlanner, "__init__"),  # a class that is not on the allow-list
        Getattr(__import__("pathlib").PosixPath, "home"),  # an allowed class that is not an enum
        Getattr(__import__("torch.distributed.checkpoint.metadata").distributed.checkpoint.metadata
                ._MEM_FORMAT_ENCODING, "__init__"),  # an allowed enum, not one of its members
        Getattr(__import__("torch.distributed.checkpoint.metadata").distributed.checkpoint.metadata
                ._MEM_FORMAT_ENCODING, "_member_map_"),
    ],
    ids=["getattr-os-system", "not-allowed-class", "allowed-non-enum", "enum-method", "enum-private"],
)
def test_getattr_reaches_nothing_but_an_enum_member(pristine, tmp_path, payload, reliability_report):
    target = copy(pristine, tmp_path, "evil-getattr")
    marker = tmp_path / "PWNED-getattr"
    if payload == "os-system":
        evil = _run_code_through_getattr(marker)
    else:
        md = pickle.loads((pristine / ".metadata").read_bytes())
        md.planner_data["__dmuon__"]["payload"] = payload
        evil = pickle.dumps(md)
    rewrite(target, evil)
    with pytest.raises(ddcp.UnsafeCheckpointError, match="refusing to unpickle"):
        open_checkpoint(str(target))
    assert not marker.exists()
    reliability_report.setdefault("hostile", {})["getattr beyond enum members"] = "refused, no code ran"
