"""Which store serves a location (dmuon/dcp/storage/registry.py): built-in backends, users'
registrations in front of them, and the one place paths and URLs are split."""
import os

import pytest

from dmuon.dcp.storage.fsspec_store import FsspecStore
from dmuon.dcp.storage.local import LocalStore
from dmuon.dcp.storage.registry import is_remote, open_store, register_store, split_location, unregister_store


def test_plain_paths_and_file_urls_are_local_directories(tmp_path):
    for location in (str(tmp_path), f"file://{tmp_path}"):
        store = open_store(location)
        assert isinstance(store, LocalStore) and store.root == str(tmp_path)
    assert open_store(tmp_path, sync_files=False).sync_files is False


def test_a_local_directory_refuses_options_it_does_not_take(tmp_path):
    with pytest.raises(ValueError, match="do not apply to the local path"):
        open_store(tmp_path, {"key": "x"})
    with pytest.raises(ValueError, match="want true, false or null"):
        open_store(tmp_path, {"direct_io": "yes"})
    assert open_store(tmp_path, {"direct_io": False}).direct_io is False


def test_any_other_scheme_goes_to_fsspec():
    assert isinstance(open_store("memory://registry-test/a"), FsspecStore)


def test_a_registered_backend_comes_first_and_unregistering_restores_the_built_in(tmp_path):
    made = []

    def factory(url, storage_options, sync_files):
        made.append((url, storage_options, sync_files))
        return LocalStore(str(tmp_path))

    register_store("memory", factory)
    try:
        store = open_store("memory://x/y", {"opt": 1}, sync_files=True)
        assert isinstance(store, LocalStore) and made == [("memory://x/y", {"opt": 1}, True)]
    finally:
        unregister_store("memory")
    assert isinstance(open_store("memory://x/y"), FsspecStore)
    unregister_store("never-registered")  # no error


def test_locations_split_into_directory_and_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert split_location("s3://bucket/run/model.safetensors") == ("s3://bucket/run", "model.safetensors")
    assert split_location("file:///data/x.pt") == ("file:///data", "x.pt")
    assert split_location("out/model.pt") == (os.path.join(str(tmp_path), "out"), "model.pt")
    assert split_location("model.pt/") == (str(tmp_path), "model.pt")
    assert is_remote("gs://b/x") and not is_remote("file:///x") and not is_remote("/x")
