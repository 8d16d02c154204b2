"""dmuon's writer of the torch.save format (format/torch_file.py, format/torch_zip.py): torch.load
reads it, zip readers parse it."""
import io
import zipfile

import pytest
import torch

from dmuon.dcp.format import tensor_bytes, torch_file, torch_zip


@pytest.mark.parametrize("tensor", [
    torch.arange(12, dtype=torch.float32).view(3, 4),
    torch.randn(5, 7).to(torch.bfloat16),
    torch.tensor(3.5),
    torch.empty(0, 4),
    torch.arange(10, dtype=torch.int64),
    torch.tensor([True, False, True]),
], ids=["f32", "bf16", "scalar", "empty", "i64", "bool"])
def test_a_written_payload_loads_with_torch_and_as_a_view(tensor):
    out = io.BytesIO()
    torch_file.write_tensor_payload(out, tensor)
    data = out.getvalue()
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True), tensor)
    assert torch.equal(torch_file.tensor_from_payload(data, tuple(tensor.shape), tensor.dtype), tensor)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        [record] = [i for i in archive.infolist() if "/data/" in i.filename]
    start = torch_zip.single_record_offset(data, tensor.numel() * tensor.element_size())
    if tensor.numel():
        assert start is not None and start % torch_zip.STORAGE_ALIGNMENT == 0
        assert record.file_size == tensor.numel() * tensor.element_size()


def test_zip64_records_and_offsets_load(monkeypatch):
    monkeypatch.setattr(torch_zip, "_ZIP64_LIMIT", 64)  # every record and offset past "4 GiB"
    tensor = torch.arange(100, dtype=torch.float32)
    out = io.BytesIO()
    torch_file.write_tensor_payload(out, tensor)
    data = out.getvalue()
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True), tensor)
    assert torch.equal(torch_file.tensor_from_payload(data, (100,), torch.float32), tensor)


def test_a_multi_tensor_file_with_shared_storages_loads():
    a, b = torch.randn(4, 4), torch.arange(3.0)
    out = io.BytesIO()
    writer = torch_zip.TorchFileWriter(out)
    pickled = torch_file.pickled_tensors({"a": ("0", a.dtype, (4, 4)), "tied": ("0", a.dtype, (4, 4)),
                                          "b": ("1", b.dtype, (3,))})
    torch_file.write_preamble(writer, pickled)
    writer.write_record("data/0", tensor_bytes.tensor_memory(a), align=True)
    writer.write_record("data/1", tensor_bytes.tensor_memory(b), align=True)
    torch_file.write_postamble(writer)
    loaded = torch.load(io.BytesIO(out.getvalue()), weights_only=True)
    assert list(loaded) == ["a", "tied", "b"]
    assert torch.equal(loaded["a"], a) and torch.equal(loaded["tied"], a) and torch.equal(loaded["b"], b)
    assert loaded["a"].untyped_storage().data_ptr() == loaded["tied"].untyped_storage().data_ptr()


def _in_one_go(tensor: torch.Tensor, place) -> bytes:
    """The payload written by one TorchFileWriter, record after record (no cached framing)."""
    out = io.BytesIO()
    writer = torch_zip.TorchFileWriter(out)
    torch_file.write_preamble(writer, torch_file._pickled_tensor(tensor.dtype, tuple(tensor.shape)))
    writer.write_record("data/0", tensor_bytes.tensor_memory(tensor), align=True, place=place)
    torch_file.write_postamble(writer)
    return out.getvalue()


@pytest.mark.parametrize("place", [None, (4096, 0), (4096, 1234), (4096, 4095), (512, 77)])
def test_cached_frames_write_the_same_bytes_as_one_writer_and_place_the_data(place):
    frames = torch_file.TensorFrames()
    tensors = [torch.randn(3, 5), torch.randn(3, 5), torch.randn(5, 3), torch.randn(3, 5).to(torch.bfloat16)]
    for tensor in tensors:
        cached = io.BytesIO()
        torch_file.write_tensor_payload(cached, tensor, frames=frames, place=place)
        payload = cached.getvalue()
        assert payload == _in_one_go(tensor, place)
        start = torch_zip.single_record_offset(payload, tensor.numel() * tensor.element_size())
        modulus, residue = place or (torch_zip.STORAGE_ALIGNMENT, 0)
        assert start is not None and start % modulus == residue
        assert torch.equal(torch.load(io.BytesIO(payload), weights_only=True), tensor)
    assert len(frames._frames) == 3 and len(frames._preambles) == 3  # one per (dtype, shape)
