"""Make torchtitan 0.3.0's Trainer importable and runnable on a CPU-only machine (gloo).

torchtitan assumes an accelerator in two places that have nothing to do with dmuon:

* ``torchtitan.tools.utils`` picks ``device_type = _get_available_device_type() or "cuda"`` at
  import and copies it (with ``device_module = torch.cuda``) into several modules by value. The
  Trainer then calls ``torch.cuda.set_device``, its memory monitor asks CUDA for device names
  and memory statistics, and the device mesh is built for ``"cuda"``. :func:`use_cpu` points
  every copy at ``"cpu"`` and at :data:`CPU_DEVICE_MODULE`, which answers what is asked.
* ``torchtitan.models.common`` imports ``torchtitan.distributed.minimal_async_ep``, whose
  ``kernels.py`` imports triton unconditionally (MoE expert-parallel kernels). CPU torch has no
  triton. :func:`stub_triton_kernels` registers that one kernels module with functions that
  raise. Only the ``minimal_async_ep`` token dispatcher calls them: a dense model does not, nor
  an MoE with the all-to-all dispatcher (``comm_backend="standard"``), which is all torch ops
  and ``all_to_all_single`` (gloo has it), expert parallelism included. Where triton is
  installed nothing is stubbed.
* ``torchtitan.trainer`` imports its HuggingFace dataloaders, which import ``datasets``. That
  package is left out of the test environment: torchtitan pins ``datasets<4.8``, whose fsspec
  pin is older than what s3fs and gcsfs need. :func:`stub_datasets` registers a ``datasets``
  whose loaders raise; the tests bring their own dataloader. Where it is installed, nothing
  is stubbed.

* torchtitan's FSDP sums gradients (``set_gradient_divide_factor(1.0)``: its loss is already
  divided by the global token count), which FSDP2 does with ``ReduceOp.PREMUL_SUM``; gloo has
  none. :func:`gloo_parallelize` wraps a ``parallelize_fn`` so that its FSDP modules use plain
  sums (``set_force_sum_reduction_for_comms``): the same gradients, for gloo.

* Not CPU-specific: after the first step the Trainer calls ``torch.distributed.set_timeout``,
  which torch 2.13 does not have (torchtitan 0.3.0 was built against a newer torch); it has
  ``distributed_c10d._set_pg_timeout``, which :func:`add_set_timeout` names so.
* Not CPU-specific either: with pipeline stages the Trainer splits each batch into microbatches
  itself and calls ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=...,
  loss_kwargs=...)``. torch 2.13's ``step`` takes the whole batch and splits it (those keywords
  would reach the model as inputs); what runs the given microbatches is its
  ``_step_microbatches``, with the same parameter names. :func:`presplit_pipelining` wraps a
  ``pipelining_fn`` so that its schedule's ``step`` accepts the split form: the per-step
  preparation torch's ``step`` does (each stage's ``has_backward``, cleared runtime state), then
  ``_step_microbatches``. Where ``step`` already takes ``arg_mbs`` nothing is wrapped.

Call :func:`prepare` before the first torchtitan import that reaches ``models.common``.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel", "topk_scores_grad_kernel",
)
# every module that copied torchtitan.tools.utils' device globals at import
_DEVICE_USERS = (
    "torchtitan.tools.utils", "torchtitan.distributed.utils", "torchtitan.distributed.parallel_dims",
    "torchtitan.components.metrics", "torchtitan.models.common.token_dispatcher", "torchtitan.tools.profiler",
)


@dataclass
class _Properties:
    total_memory: int


class _CpuDeviceModule(types.SimpleNamespace):
    """What torchtitan asks of ``torch.cuda``, answered for the CPU (no statistics: -1)."""

    @staticmethod
    def set_device(device) -> None:
        return None

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None) -> _Properties:
        return _Properties(total_memory=1 << 30)

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def is_available() -> bool:
        return True


CPU_DEVICE_MODULE = _CpuDeviceModule()


def _raise_no_triton(*args, **kwargs):
    raise RuntimeError("torchtitan's MoE expert-parallel kernels need triton, which is not installed")


def stub_triton_kernels() -> None:
    """Let ``torchtitan.models.common`` import without triton (see the module docstring)."""
    if importlib.util.find_spec("triton") is not None or _KERNELS in sys.modules:
        return
    stub = types.ModuleType(_KERNELS)
    stub.__doc__ = "stub: triton is not installed (tests/helpers/titan_cpu.py)"
    for name in _KERNEL_NAMES:
        setattr(stub, name, _raise_no_triton)
    sys.modules[_KERNELS] = stub


def stub_datasets() -> None:
    """Let ``torchtitan.trainer`` import without ``datasets`` (see the module docstring)."""
    if importlib.util.find_spec("datasets") is not None:
        return
    root = types.ModuleType("datasets")
    root.__doc__ = "stub: datasets is not installed (tests/helpers/titan_cpu.py)"
    root.Dataset = type("Dataset", (), {})  # type: ignore[attr-defined]
    root.load_dataset = _raise_no_datasets  # type: ignore[attr-defined]
    distributed = types.ModuleType("datasets.distributed")
    distributed.split_dataset_by_node = _raise_no_datasets  # type: ignore[attr-defined]
    root.distributed = distributed  # type: ignore[attr-defined]
    sys.modules["datasets"] = root
    sys.modules["datasets.distributed"] = distributed


def _raise_no_datasets(*args, **kwargs):
    raise RuntimeError("torchtitan's HuggingFace dataloaders need the datasets package, which is not installed")


def use_cpu() -> None:
    """Point torchtitan's device globals at the CPU (see the module docstring)."""
    for name in _DEVICE_USERS:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"  # type: ignore[attr-defined]
        if hasattr(module, "device_module"):
            module.device_module = CPU_DEVICE_MODULE  # type: ignore[attr-defined]


def gloo_parallelize(parallelize_fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``parallelize_fn``, then FSDP reductions as plain sums (see the module docstring)."""

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, **kwargs: Any) -> nn.Module:
        model = parallelize_fn(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize


def presplit_pipelining(pipelining_fn: Callable[..., tuple]) -> Callable[..., tuple]:
    """``pipelining_fn``, with a schedule that takes microbatches split already (see the module docstring)."""

    @functools.wraps(pipelining_fn)
    def pipelining(model: nn.Module, **kwargs: Any) -> tuple:
        schedule, *rest = pipelining_fn(model, **kwargs)
        if "arg_mbs" not in inspect.signature(schedule.step).parameters:
            schedule.step = functools.partial(_step_presplit, schedule)
        return (schedule, *rest)

    return pipelining


def _step_presplit(schedule, *, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
                   loss_kwargs=None):
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        stage.has_backward = schedule._has_backward
        stage.clear_runtime_states()
    schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
    if return_outputs:
        for stage in stages:
            if stage.is_last:
                return schedule._merge_outputs(stage.output_chunks)
    return None


def add_set_timeout() -> None:
    """``torch.distributed.set_timeout`` for torch releases without it (see the module docstring)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]


def prepare() -> None:
    """All of the above, once per process (each step is a no-op where it is not needed)."""
    stub_triton_kernels()
    stub_datasets()
    add_set_timeout()
    if torch.cuda.is_available():
        return
    use_cpu()
