"""HostStaging: accelerator tensors reach host memory through a few reused buffers, one copy
ahead of the writer. On CPU the same bookkeeping runs with ``stage_host_tensors=True``."""
import io

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dmuon
import dmuon.dcp as ddcp
from dmuon.dcp.host_staging import HostStaging
from dmuon.dcp.storage.local import LOCAL_DIRECT_IO_OPTION
from tests.helpers.launch import run_ranks
from tests.helpers.models import Wide
from tests.helpers.setup import make_mesh, max_abs_diff, shard_model


def test_items_arrive_in_order_with_their_values_through_two_reused_buffers():
    torch.manual_seed(0)
    values = [
        torch.randn(64, 64),
        torch.arange(10, dtype=torch.int64),
        io.BytesIO(b"not a tensor"),
        torch.randn(3, 5).t(),  # not contiguous: copied on its own
        torch.empty(0, 4),
        torch.randn(300, 300),  # larger than a slot here: copied on its own
        torch.tensor([True, False, True]),
        torch.randn(16, 16, dtype=torch.bfloat16),
    ]
    staging = HostStaging(slots=2, slot_bytes=64 * 64 * 4, stage_host_tensors=True)
    seen = []
    for key, staged in staging.items(enumerate(values)):
        want = values[key]
        if isinstance(want, torch.Tensor):
            assert staged.data.dtype == want.dtype and staged.data.shape == want.shape
            # checked while the next item's copy has already gone into the other buffer
            assert torch.equal(staged.data, want), key
            if staged.reused:
                assert staged.data.data_ptr() != want.data_ptr()  # a staging buffer, not the source
        else:
            assert staged.data is want and not staged.reused
        seen.append(key)
    assert seen == list(range(len(values)))
    assert staging._allocated == 2  # never more buffers than slots
    assert staging.staged == 4  # the four contiguous tensors that fit


def test_at_least_two_slots():
    with pytest.raises(ValueError, match="at least 2 slots"):
        HostStaging(slots=1)


def staged_save_worker(rank, world, path, direct):
    torch.manual_seed(0)
    model = Wide()  # 16 matrices of 1 MiB: large enough to be written from memory on direct I/O
    _, opt = shard_model(model, make_mesh(), lambda n, p: int(n.split(".")[1]) % 2 == 0, wrap=("blocks",))
    writer = ddcp.DMuonStorageWriter(path, storage_options={LOCAL_DIRECT_IO_OPTION: direct})
    writer.stage_host_tensors = True  # every tensor through the two reused buffers
    dcp.save(ddcp.AppState(model, opt).state_dict(), storage_writer=writer, planner=ddcp.DMuonSavePlanner())
    want = dmuon.get_model_state_dict(model, rank0_only=False)
    fresh = Wide()
    _, fresh_opt = shard_model(fresh, make_mesh(), lambda n, p: int(n.split(".")[1]) % 2 == 0, wrap=("blocks",))
    ddcp.load(fresh, fresh_opt, path)
    return max_abs_diff(dmuon.get_model_state_dict(fresh, rank0_only=False), want)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_save_through_the_staging_buffers_loads_bit_exactly(tmp_path, direct):
    from dmuon.dcp.storage.local import DIRECT_IO_FILESYSTEMS, filesystem_type

    if direct and filesystem_type(str(tmp_path)) not in DIRECT_IO_FILESYSTEMS:
        pytest.skip("no direct I/O here")
    path = str(tmp_path / "ckpt")
    assert run_ranks(staged_save_worker, 2, path, direct) == [0.0, 0.0]
    assert ddcp.verify(path) == []


@pytest.mark.parametrize("lend", [True, False])
def test_a_reused_buffer_is_never_written_from_in_place(tmp_path, lend):
    """A staging buffer is refilled once its item is written: the file must have copied it, not
    borrowed it (a direct-I/O write from the caller's memory finishes later, in the background)."""
    from dmuon.dcp.format.checksums import WRITE_CHECKSUM
    from dmuon.dcp.storage.direct_io import DirectFile
    from dmuon.dcp.storage.local import DIRECT_IO_FILESYSTEMS, filesystem_type
    from dmuon.dcp.format.torch_file import TensorFrames
    from dmuon.dcp.writer import _ChecksummingStream, _write_item

    if filesystem_type(str(tmp_path)) not in DIRECT_IO_FILESYSTEMS:
        pytest.skip("no direct I/O here")
    tensor = torch.randn(1024, 1024)  # 4 MiB: lent where allowed
    f = DirectFile(str(tmp_path / "data"))
    try:
        stream = _ChecksummingStream(f, WRITE_CHECKSUM)
        _write_item(stream, tensor, TensorFrames(), lend=lend)
        f.flush()
        assert (f.in_place_bytes > 0) == lend, f.in_place_bytes
    finally:
        f.close()


def test_uploads_commit_each_item_once_its_copy_landed_and_reuse_two_buffers():
    from dmuon.dcp.host_staging import DeviceUploads

    torch.manual_seed(0)
    sources = [torch.randn(32, 32) for _ in range(5)]
    targets = [torch.zeros(32, 32) for _ in sources]
    uploads = DeviceUploads(slots=2, slot_bytes=32 * 32 * 4, stage_host_tensors=True)
    committed, buffers = [], set()
    for i, (source, target) in enumerate(zip(sources, targets)):
        assert uploads.takes(target, source.numel() * 4)
        host = uploads.buffer((32, 32), torch.float32, target.device)
        buffers.add(host.untyped_storage().data_ptr())
        # item i may reuse a buffer only once item i - 2's copy landed and was committed
        assert committed == list(range(max(i - 1, 0))), (i, committed)
        host.copy_(source)  # (what the read does: bytes into the buffer)
        uploads.upload(host, target, lambda i=i: committed.append(i))
    uploads.finish()
    assert committed == list(range(len(sources)))
    assert len(buffers) == 2  # two buffers, reused
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))
    assert not uploads.takes(torch.zeros(64, 64), 64 * 64 * 4)  # larger than a buffer: not taken
    assert not DeviceUploads().takes(torch.zeros(4), 16)  # a CPU target, not staged: not taken


def staged_load_worker(rank, world, path):
    torch.manual_seed(0)
    model = Wide()
    predicate = lambda n, p: int(n.split(".")[1]) % 2 == 0  # noqa: E731
    _, opt = shard_model(model, make_mesh(), predicate, wrap=("blocks",))
    ddcp.save(model, opt, path)
    want = dmuon.get_model_state_dict(model, rank0_only=False)
    fresh = Wide()
    _, fresh_opt = shard_model(fresh, make_mesh(), predicate, wrap=("blocks",))
    reader = ddcp.DMuonStorageReader(path)
    reader.stage_host_tensors = True  # every tensor the reader cannot fill in place: through the buffers
    state = ddcp.AppState(fresh, fresh_opt)
    sd = state.state_dict()
    dcp.load(sd, storage_reader=reader, planner=ddcp.DMuonLoadPlanner())
    state.load_state_dict(sd)
    return max_abs_diff(dmuon.get_model_state_dict(fresh, rank0_only=False), want), reader.uploaded


def test_a_load_through_the_upload_buffers_is_bit_exact(tmp_path):
    results = run_ranks(staged_load_worker, 2, str(tmp_path / "ckpt"))
    assert [diff for diff, _ in results] == [0.0, 0.0]
    assert all(uploaded > 0 for _, uploaded in results)  # the buffered path ran on every rank
