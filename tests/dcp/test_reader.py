"""DMuonStorageReader: the order it reads a data file in, against a real S3 server."""
import pytest
import torch
import torch.distributed.checkpoint as dcp

import dmuon.dcp as ddcp
from dmuon.dcp.checkpoint import open_checkpoint
from dmuon.dcp.storage.fsspec_store import FsspecStore
from dmuon.dcp.storage.ranged_reader import RangedReader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose

BLOCK = 64 << 10  # read-ahead blocks far smaller than the file, as 16 MiB ones are for a real one


class _SmallBlockStore(FsspecStore):
    """The real S3 store, with small read-ahead blocks, keeping the streams it opened."""

    def __init__(self, url, options) -> None:
        super().__init__(url, options)
        self.streams: list[RangedReader] = []

    def open_read(self, name, size=None):
        path = self._path(name)
        stream = RangedReader(self.fs, path, self.fs.size(path), block_bytes=BLOCK, concurrency=2)
        self.streams.append(stream)
        return stream


def test_a_load_fetches_each_byte_of_a_data_file_about_once(s3_server):
    """Items are read in file order, each one's frame next to its data: a reader that jumped
    ahead (say, checking every item's frame first) would make the read-ahead fetch the file
    twice. 40 items of 32 KiB in one file, read through 64 KiB blocks, two ahead."""
    url = s3_server.url()
    saved = {f"w{i}": torch.randn(64, 128) for i in range(40)}
    dcp.save(saved, storage_writer=ddcp.DMuonStorageWriter(url, storage_options=s3_server.storage_options))
    store = _SmallBlockStore(url, s3_server.storage_options)
    try:
        listing = open_checkpoint(url, store=store)
        loaded = {key: torch.zeros_like(value) for key, value in saved.items()}
        dcp.load(loaded, storage_reader=ddcp.DMuonStorageReader(url, listing=listing))
        assert all(torch.equal(loaded[key], value) for key, value in saved.items())
        [stream] = store.streams
        assert stream.size > 20 * BLOCK
        assert stream.bytes_fetched <= 1.1 * stream.size, (stream.bytes_fetched, stream.size)
    finally:
        store.remove_tree()
