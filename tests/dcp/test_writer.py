"""DMuonStorageWriter: where tensor bytes land in a data file, and that every reader still reads them."""
import io

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dmuon.dcp as ddcp
from dmuon.dcp.checkpoint import open_checkpoint
from dmuon.dcp.storage.direct_io import BORROW_MIN_BYTES, DIRECT_IO_ALIGN
from dmuon.dcp.storage.local import DIRECT_IO_FILESYSTEMS, LOCAL_DIRECT_IO_OPTION, filesystem_type

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    offset_view = torch.randn(1025, 512)[1:]  # data_ptr 2 KiB past its storage's start
    return {
        "big": torch.randn(512, 1024),  # 2 MiB
        "odd": torch.randn(333, 1001, dtype=torch.float64),  # 2.7 MB, rows not a power of two
        "view": offset_view,
        "half": torch.randn(1024, 600, dtype=torch.bfloat16),  # 1.2 MB
        "small": torch.randn(16, 16),  # under the in-place threshold: not padded
        "obj": {"step": 7},
    }


def test_large_tensors_lie_in_the_file_as_they_lie_in_memory_and_load_everywhere(tmp_path):
    """On a direct-I/O filesystem a tensor of >= BORROW_MIN_BYTES starts at a file offset
    congruent to its address (so it is written from its own memory, no copy); the checkpoint
    still loads with dmuon's reader, with torch's own reader, and verifies."""
    if filesystem_type(str(tmp_path)) not in DIRECT_IO_FILESYSTEMS:
        pytest.skip("no direct I/O here: tensors are copied, not lined up")
    direct = {LOCAL_DIRECT_IO_OPTION: True}  # the default is measured: ask for direct I/O
    saved = _tensors()
    addresses = {key: t.data_ptr() for key, t in saved.items() if isinstance(t, torch.Tensor)}
    path = str(tmp_path / "ckpt")
    dcp.save(saved, storage_writer=ddcp.DMuonStorageWriter(path, storage_options=direct))

    listing = open_checkpoint(path)
    lined_up = []
    for index, info in listing.metadata.storage_data.items():
        item = listing.data_blocks(index)
        if item is None:
            continue
        tensor = saved[index.fqn]
        if tensor.numel() * tensor.element_size() < BORROW_MIN_BYTES:
            continue
        assert (info.offset + item.head) % DIRECT_IO_ALIGN == addresses[index.fqn] % DIRECT_IO_ALIGN, index.fqn
        lined_up.append(index.fqn)
    assert sorted(lined_up) == ["big", "half", "odd", "view"]
    assert listing.verify_files() == []

    for reader in (ddcp.DMuonStorageReader(path), dcp.FileSystemReader(path)):
        loaded = {key: torch.zeros_like(t) if isinstance(t, torch.Tensor) else {"step": 0} for key, t in saved.items()}
        dcp.load(loaded, storage_reader=reader)
        for key, value in saved.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(loaded[key], value), (type(reader).__name__, key)
        assert loaded["obj"] == {"step": 7}


def test_a_lined_up_item_is_a_torch_save_file_of_its_tensor(tmp_path):
    """The padding that lines a tensor up is zip padding torch.load reads past."""
    if filesystem_type(str(tmp_path)) not in DIRECT_IO_FILESYSTEMS:
        pytest.skip("no direct I/O here")
    saved = {"big": torch.randn(512, 1024)}
    path = tmp_path / "ckpt"
    direct = {LOCAL_DIRECT_IO_OPTION: True}
    dcp.save(saved, storage_writer=ddcp.DMuonStorageWriter(str(path), storage_options=direct))
    listing = open_checkpoint(str(path))
    ((_, info),) = listing.metadata.storage_data.items()
    payload = (path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    assert torch.equal(torch.load(io.BytesIO(payload), weights_only=True), saved["big"])
