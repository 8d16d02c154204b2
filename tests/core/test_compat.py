"""Each private torch name in dmuon/compat.py exists and behaves as dmuon relies on."""
import importlib
import inspect

import torch

from dmuon import compat
from dmuon.dcp.format.safe_metadata import load_metadata_bytes
from tests.helpers.launch import run_ranks


def test_storage_info_is_a_file_range_torch_reads():
    info = compat.StorageInfo("__0_x.distcp", 5, 7)
    assert (info.relative_path, info.offset, info.length) == ("__0_x.distcp", 5, 7)
    assert compat.CURRENT_DCP_VERSION.count(".") == 2


def test_set_element_builds_nested_containers():
    root: dict = {}
    compat.set_element(root, ("extra", "loader", "epoch"), 3)
    compat.set_element(root, ("extra", "rng", 1), 9)
    assert root == {"extra": {"loader": {"epoch": 3}, "rng": [None, 9]}}


def test_pickling_helpers_rebuild_tensors():
    tensor = torch.arange(6, dtype=torch.float32).view(2, 3)
    assert getattr(torch, compat.storage_type_names()[torch.float32]) is torch.FloatStorage
    rebuilt = compat.rebuild_tensor(tensor.storage(), 0, (2, 3), (3, 1), False, {})
    assert rebuilt.equal(tensor)


def test_fsdp_patch_target_takes_ignored_params():
    target = getattr(importlib.import_module(compat.FSDP_PATCH_MODULE), compat.FSDP_PATCH_TARGET)
    assert "ignored_params" in inspect.signature(target).parameters


def test_tree_flatten_finds_the_tensors_of_a_nested_output():
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    leaves, _ = compat.tree_flatten({"x": (a, [b]), "y": {"z": c}, "n": 3})
    assert [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)] == [a, b, c]


def test_pickled_metadata_names_no_other_private_global(tmp_path):
    import io
    import pickle

    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2, 3), "obj": {"epoch": 1}}, checkpoint_id=str(tmp_path), no_dist=True)
    names = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            names.add((module, name))
            return super().find_class(module, name)

    raw = (tmp_path / ".metadata").read_bytes()
    Recording(io.BytesIO(raw)).load()
    # torch's private names live in compat.py; the standard library's (Python 3.13 pickles a
    # path as pathlib._local.PosixPath) are the safe unpickler's to map, checked by loading it
    private = {
        (module, name)
        for module, name in names
        if module.split(".")[0] == "torch" and (name.startswith("_") or "._" in module)
    }
    assert private and private <= compat.PICKLED_METADATA_GLOBALS
    assert "w" in load_metadata_bytes(raw, str(tmp_path)).state_dict_metadata
    for module, name in compat.PICKLED_METADATA_GLOBALS:
        assert getattr(importlib.import_module(module), name) is not None


def test_default_planners_keep_the_state_dmuon_plans_with():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    weight, other = torch.ones(2), torch.zeros(3)
    nested = {"a": {"b": weight}, "c": other}
    saver = DefaultSavePlanner()
    saver.set_up_planner(nested, is_coordinator=True)
    assert compat.planner_flat_state(saver) == {"a.b": weight, "c": other}
    assert compat.planner_mappings(saver) == {"a.b": ("a", "b"), "c": ("c",)}
    compat.set_planner_flat_state(saver, {"a.b": weight})  # what is planned and resolved follows
    plan = saver.create_local_plan()
    assert [item.index.fqn for item in plan.items] == ["a.b"]
    assert saver.resolve_data(plan.items[0]) is weight

    _, metadata = saver.create_global_plan([saver.create_local_plan()])
    loader = DefaultLoadPlanner()
    target = {"a": {"b": torch.zeros(2)}}
    loader.set_up_planner(target, metadata, is_coordinator=True)
    assert compat.planner_nested_state(loader) is target
    assert list(compat.planner_flat_state(loader)) == ["a.b"] and compat.planner_mappings(loader)["a.b"] == ("a", "b")
    replacement = torch.full((2,), 7.0)
    compat.set_planner_flat_state(loader, {"a.b": replacement})
    [read] = loader.create_local_plan().items
    assert loader.resolve_tensor(read).data_ptr() == replacement.data_ptr()


def test_optimizer_load_state_dict_hooks_are_the_registered_ones():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert compat.optimizer_load_state_dict_hooks(optimizer) == ([], [])

    def pre(opt, state_dict):
        return None

    def post(opt):
        return None

    optimizer.register_load_state_dict_pre_hook(pre)
    optimizer.register_load_state_dict_post_hook(post)
    assert compat.optimizer_load_state_dict_hooks(optimizer) == ([pre], [post])


def request_worker(rank, world):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    seen = []

    class Probe(torch.nn.Linear):
        def state_dict(self, *args, **kwargs):
            seen.append(compat.state_dict_request("model"))
            return super().state_dict(*args, **kwargs)

    model = Probe(2, 2)
    get_model_state_dict(model)
    get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    model.state_dict()
    return seen


def test_state_dict_request_reads_the_options_torch_was_called_with():
    seen = run_ranks(request_worker, 1)[0]
    assert seen == [compat.StateDictRequest(False, False), compat.StateDictRequest(True, True), None]


def async_thread_worker(rank, world, path):
    import threading

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    future = dcp.async_save({"w": torch.ones(4)}, checkpoint_id=path, process_group=dist.new_group(backend="gloo"))
    names = [t.name for t in threading.enumerate()]
    future.result()
    return names


def test_torch_async_save_runs_on_a_thread_named_with_the_prefix(tmp_path):
    names = run_ranks(async_thread_worker, 1, str(tmp_path / "ckpt"))[0]
    assert any(name.startswith(compat.DCP_ASYNC_THREAD_PREFIX) for name in names), names


def test_checkpoint_wrapper_prefix_is_in_parameter_names_and_not_in_state_dict_keys():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    outer = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(2, 2)))
    names = [name for name, _ in outer.named_parameters()]
    assert names == [f"0.{compat.CHECKPOINT_WRAPPER_PREFIX}weight", f"0.{compat.CHECKPOINT_WRAPPER_PREFIX}bias"]
    assert list(outer.state_dict()) == ["0.weight", "0.bias"]
    assert [compat.state_dict_name(name) for name in names] == list(outer.state_dict())


class _AsksForItsWriteItems:
    """An object of a state dict that answers DCP's checkpointable protocol by its name."""

    def __init__(self):
        self.asked = []


def test_torch_default_save_planner_asks_an_object_for_its_write_items_by_the_protocol_name():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    thing = _AsksForItsWriteItems()
    setattr(thing, compat.CREATE_WRITE_ITEMS, lambda fqn, obj: thing.asked.append((fqn, obj)) or [])
    planner = DefaultSavePlanner()
    planner.set_up_planner({"probe": thing, "w": torch.ones(2)}, is_coordinator=True)
    planner.create_local_plan()
    assert thing.asked == [("probe", thing)]


def test_is_strided_shard_knows_dtensors_strided_shard_and_nothing_else():
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    assert compat.is_strided_shard(_StridedShard(0, split_factor=2))
    assert not compat.is_strided_shard(Shard(0)) and not compat.is_strided_shard(Replicate())


def test_compat_names_are_all_exercised():
    tested = {"collective_count", "default_store", "CHECKPOINT_WRAPPER_PREFIX", "CREATE_WRITE_ITEMS", "state_dict_name", "StorageInfo", "DCP_ASYNC_THREAD_PREFIX", "CURRENT_DCP_VERSION", "set_element", "rebuild_tensor", "storage_type_names",
              "FSDP_PATCH_MODULE", "FSDP_PATCH_TARGET", "state_dict_request", "StateDictRequest", "TorchCompatError",
              "missing_features", "require_all", "tree_flatten", "PICKLED_METADATA_GLOBALS", "planner_flat_state",
              "set_planner_flat_state", "planner_mappings", "planner_nested_state", "optimizer_load_state_dict_hooks",
              "is_strided_shard", "local_shape_and_offset"}
    assert set(compat.__all__) == tested


def test_local_shape_and_offset_places_any_ranks_piece_without_a_process_group():
    from torch.distributed.tensor.placement_types import Replicate, Shard

    # a 43 x 16 matrix on a 2 x 2 mesh, rows cut on mesh dim 0 (22 + 21), columns on dim 1
    pieces = {(r, c): compat.local_shape_and_offset((43, 16), (2, 2), [r, c], (Shard(0), Shard(1)))
              for r in range(2) for c in range(2)}
    assert [(tuple(size), tuple(offset)) for size, offset in pieces.values()] == [
        ((22, 8), (0, 0)), ((22, 8), (0, 8)), ((21, 8), (22, 0)), ((21, 8), (22, 8))]
    size, offset = compat.local_shape_and_offset((43, 16), (2, 2), [1, 1], (Replicate(), Shard(0)))
    assert (tuple(size), tuple(offset)) == ((21, 16), (22, 0))


# A torch that lacks the private names: a subprocess hides them from dmuon's import (and puts
# them back for torch's own use), as a newer torch that renamed them would look to dmuon.
_WITHOUT_PRIVATE_NAMES = r"""
import sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as fs
import torch.distributed.checkpoint.state_dict as sd

hidden = {(fs, "_StorageInfo"): fs._StorageInfo, (sd, "_get_model_state_dict"): sd._get_model_state_dict}
for (module, name) in hidden:
    delattr(module, name)
import dmuon, dmuon.dcp  # no ImportError
from dmuon import compat
for (module, name), value in hidden.items():
    setattr(module, name, value)

print("missing:", sorted(compat.missing_features()))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = torch.nn.Linear(4, 4)
optimizer = dmuon.Muon(model, lr=0.01)
model(torch.ones(2, 4)).sum().backward()
optimizer.step()  # training works
print("plain state_dict:", sorted(model.state_dict()))

class Probe(torch.nn.Linear):
    def state_dict(self, *args, **kwargs):
        compat.state_dict_request("model")
        return super().state_dict(*args, **kwargs)

for what, use in (("save", lambda: dmuon.dcp.save(model, optimizer, sys.argv[1])),
                  ("get_model_state_dict", lambda: sd.get_model_state_dict(Probe(2, 2)))):
    try:
        use()
    except Exception as exc:
        print(f"{what}: {type(exc).__name__}: {exc}")
    else:
        print(f"{what}: no error")
dist.destroy_process_group()
"""


def test_a_missing_private_name_disables_only_its_feature(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _WITHOUT_PRIVATE_NAMES, str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert "dmuon.dcp checkpoints" in lines["missing"] and "get_model_state_dict" in lines["missing"]
    assert lines["plain state_dict"] == "['bias', 'weight']"
    for what, feature, name in (("save", "dmuon.dcp checkpoints", "_StorageInfo"),
                                ("get_model_state_dict", "dedicated parameters under torch's get_model_state_dict",
                                 "_get_model_state_dict")):
        assert feature in lines[what] and name in lines[what], lines[what]
        assert f"torch {torch.__version__}" in lines[what], lines[what]
    assert lines["save"].startswith("TorchCompatError: "), lines["save"]  # before anything is written
    assert not (tmp_path / "ckpt").exists()


def store_and_count_worker(rank, world):
    import torch
    import torch.distributed as dist

    store = compat.default_store()
    before = compat.collective_count()
    dist.all_reduce(torch.ones(1))
    store.set(f"compat-test/{rank}", b"here")
    other = store.get(f"compat-test/{1 - rank}")  # (waits for it)
    after = compat.collective_count()
    dist.barrier()  # read everything before any rank leaves: rank 0 hosts the store
    return before, after, other


def test_default_store_and_collective_count_are_the_same_on_every_rank():
    results = run_ranks(store_and_count_worker, 2)
    assert results[0][:2] == results[1][:2] and results[0][1] > results[0][0]
    assert results[0][2] == results[1][2] == b"here"
