"""Checkpoints written by earlier dmuon releases, and on every Python the package claims, load,
verify and export with today's code on the Python running the tests."""
import shutil
from pathlib import Path

import pytest
import torch

import dmuon
import dmuon.dcp as ddcp
from tests.helpers.launch import run_ranks
from tests.helpers.models import OddShapes
from tests.helpers.setup import make_mesh, max_abs_diff, shard_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# fixture -> (the checksum kind its manifest records, the note its save wrote into ``extra``)
RELEASES = {
    "checkpoint-v0.1.0": ("crc32", "written by dmuon c885f44"),  # manifest version 1
    "checkpoint-v0.2-crc32c": ("crc32c", "written by dmuon 65a0d7c"),  # manifest version 2
}
DEDICATED = ("mid.weight", "out.weight", "gate.weight", "inp.bias")


def load_worker(rank, world, path):
    torch.manual_seed(1)  # another initialisation than the saved run's
    model = OddShapes()
    _, opt = shard_model(model, make_mesh(), lambda n, p: n in DEDICATED, wrap=())
    extra = ddcp.load(model, opt, path)
    return {"extra": extra, "model": dmuon.get_model_state_dict(model),
            "optim": dmuon.get_optimizer_state_dict(model, opt)}


@pytest.mark.parametrize("release", sorted(RELEASES))
@pytest.mark.parametrize("world", [2, 3])
def test_an_earlier_release_checkpoint_loads_bit_exactly(tmp_path, world, release):
    fixture = FIXTURES / release
    path = tmp_path / "ckpt"
    shutil.copytree(fixture / "checkpoint", path)  # loading must not need to write
    expected = torch.load(fixture / "expected.pt", weights_only=True)
    got = run_ranks(load_worker, world, str(path))[0]
    assert got["extra"] == {"step": 2, "note": RELEASES[release][1]}
    assert max_abs_diff(got["model"], expected["model"]) == 0.0
    for section in ("fsdp2", "dedicated"):
        assert got["optim"][section].keys() == expected["optim"][section].keys()
        for fqn, entry in expected["optim"][section].items():
            assert max_abs_diff(got["optim"][section][fqn], entry) == 0.0, fqn


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_an_earlier_release_checkpoint_verifies_and_exports(tmp_path, release):
    from safetensors.torch import load_file

    fixture = FIXTURES / release
    assert ddcp.verify(fixture / "checkpoint") == []
    doc = ddcp.inspect(fixture / "checkpoint")
    assert doc["checksum"] == RELEASES[release][0] and doc["topology"] == {"replicate": 1, "shard": 2}
    [out] = ddcp.export(fixture / "checkpoint", tmp_path / "hf")
    expected = torch.load(fixture / "expected.pt", weights_only=True)["model"]
    assert max_abs_diff(load_file(out), expected) == 0.0


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_an_earlier_release_checkpoint_still_catches_a_flipped_byte(tmp_path, release):
    path = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / release / "checkpoint", path)
    victim = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    problems = ddcp.verify(path)
    assert len(problems) == 1 and problems[0].startswith(f"{victim.name}: checksum mismatch"), problems


# fixture -> the Python that wrote it (tests/fixtures/make_python_fixture.py): 3.11.2 pickles the
# enum member in TensorProperties through getattr, 3.13 names pathlib._local.PosixPath
PYTHONS = ("python-3.11.2", "python-3.13.0")
WRITERS = ("dmuon-save", "torch-writer")


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("python", PYTHONS)
def test_a_checkpoint_written_on_another_python_loads_bit_exactly(tmp_path, python, writer):
    fixture = FIXTURES / python
    path = tmp_path / "ckpt"
    shutil.copytree(fixture / writer, path)
    expected = torch.load(fixture / "expected.pt", weights_only=True)
    got = run_ranks(load_worker, 2, str(path))[0]
    assert got["extra"] == {"step": 2, "note": f"written on Python {python.removeprefix('python-')}"}
    assert max_abs_diff(got["model"], expected["model"]) == 0.0
    for section in ("fsdp2", "dedicated"):
        assert got["optim"][section].keys() == expected["optim"][section].keys()
        for fqn, entry in expected["optim"][section].items():
            assert max_abs_diff(got["optim"][section][fqn], entry) == 0.0, fqn


@pytest.mark.parametrize("python", PYTHONS)
def test_a_checkpoint_written_on_another_python_verifies_and_exports(tmp_path, python):
    from safetensors.torch import load_file

    fixture = FIXTURES / python
    assert ddcp.verify(fixture / "dmuon-save") == []
    assert ddcp.inspect(fixture / "torch-writer")["topology"] == {"replicate": 1, "shard": 2}
    expected = torch.load(fixture / "expected.pt", weights_only=True)["model"]
    for writer in WRITERS:
        [out] = ddcp.export(fixture / writer, tmp_path / writer)
        assert max_abs_diff(load_file(out), expected) == 0.0, writer
