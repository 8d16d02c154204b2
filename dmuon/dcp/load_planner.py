"""``DMuonLoadPlanner``: torch's default load planner, plus checks before any tensor changes.

DCP casts dtypes silently and, by default, stops at the first key it cannot place; a wrong
checkpoint then half-overwrites the model. This planner checks every key's shape and dtype
against the checkpoint on every rank and reports every problem at once, before any tensor is
written (``allow_partial_load=True`` skips and logs what does not fit instead).

A dedicated tensor is absent from the state dict of the ranks that do not hold it. Where the
planner knows the dedicated keys (an ``AppState``'s layout, or ``models=``), every rank checks
each of them; where it does not, the ranks that hold a key check it, and the coordinator
checks, from every rank's plan, that each key of a checked section of the checkpoint is
wanted by some rank: a key nobody holds is a wrong model, not a weight held elsewhere. Each
rank's local plan carries what it found to the coordinator, which raises one
:class:`CheckpointMismatchError` listing every rank's problems, on every rank, before DCP
reads anything.
"""

from __future__ import annotations

import dataclasses
import io
import logging
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from .. import compat
from ..dedicated_state_dict import dedicated_value_problem
from .app_state import collect_layout
from .errors import CheckpointMismatchError
from .format.layout import MODEL_SECTION, OPTIM_SECTION
from .format.sharding_index import narrowed

__all__ = ["DMuonLoadPlanner"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Findings:
    """What one rank's checks found, sent to the coordinator with its local plan."""

    problems: list[str]  # entries that do not fit, one line each
    unexplained: list[str]  # checkpoint keys of checked sections this rank neither holds nor knows


def _tensor_spec(value) -> tuple[tuple[int, ...], torch.dtype] | None:
    """(global shape, dtype) of a tensor (DTensor and ShardedTensor included), else None."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    return None


def _describe_dtype(dtype) -> str:
    return str(dtype).replace("torch.", "")


class DMuonLoadPlanner(DefaultLoadPlanner):
    """torch's default load planner, plus the checks of the module docstring; non-tensor
    entries load with ``weights_only=True``.

    Args:
        allow_partial_load: skip (and log) the keys that do not fit instead of refusing the load.
        cast_dtypes: load a floating-point entry stored in another floating-point dtype by
            casting it to the state dict's (an fp32 checkpoint into a bf16 model), as torch's
            default planner does silently; without it such an entry is refused, by name.
        models: for a plain state dict, where in it a dmuon model's ``state_dict()`` lies (as
            for :class:`~dmuon.dcp.DMuonSavePlanner`); every rank then checks every dedicated
            key, held there or not. An ``AppState`` brings its own layout and needs none.
    """

    def __init__(
        self,
        allow_partial_load: bool = False,
        *,
        models: Mapping[str, nn.Module] | None = None,
        cast_dtypes: bool = False,
    ) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True, allow_partial_load=allow_partial_load)
        self.partial = allow_partial_load
        self.cast_dtypes = cast_dtypes
        self.models = dict(models or {})
        self.skipped: list[str] = []

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        layout, layout_keys = collect_layout(state_dict, self.models)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.checkpoint = metadata
        # What every key should look like (for validation on every rank), and what this rank reads.
        self.expected: dict[str, tuple[tuple, torch.dtype] | None] = {}
        self.refused: dict[str, str] = {}
        self.dedicated = {fqn: (tuple(entry.shape), entry.dtype) for fqn, entry in layout.entries.items()}
        state = {}
        for fqn, value in compat.planner_flat_state(self).items():
            if fqn in layout_keys:
                continue
            dedicated = self.dedicated.get(fqn)
            problem = dedicated_value_problem(dedicated[0], value) if dedicated is not None else None
            if problem is not None:
                self.refused[fqn] = f"{fqn}: the state dict being loaded into holds {problem}"
            else:
                self.expected[fqn] = _tensor_spec(value)
            state[fqn] = value
        compat.set_planner_flat_state(self, state)
        # held here or not, every rank checks them: all ranks then report the same problems
        self.expected.update(self.dedicated)

    def _problems(self, stored: Mapping) -> tuple[dict[str, str], list[str]]:
        """What does not fit, by key; and the checkpoint keys this rank can neither place nor
        explain (for the coordinator to check against the other ranks' plans)."""
        problems: dict[str, str] = dict(self.refused)
        for fqn, want in self.expected.items():
            problem = _mismatch(fqn, want, stored.get(fqn), self.cast_dtypes)
            if problem is not None:
                problems[fqn] = problem
        sections = self._checked_sections()
        unexplained = [fqn for fqn in stored if fqn not in self.expected and fqn.startswith(sections)]
        return problems, unexplained

    def _checked_sections(self) -> tuple[str, ...]:
        """Prefixes (``model.``, ``app.optim.``...) where the checkpoint must hold nothing extra.

        A checkpoint with more layers than the model is a wrong model, not a partial load;
        user ``extra`` entries and sections not being loaded at all are never checked.
        """
        sections = set()
        for fqn in self.expected:
            parts = fqn.split(".")
            for i, part in enumerate(parts[:-1]):
                if part in (MODEL_SECTION, OPTIM_SECTION):
                    sections.add(".".join(parts[: i + 1]) + ".")
                    break
        return tuple(sorted(sections))

    def create_local_plan(self) -> LoadPlan:
        if self.checkpoint is None:
            raise RuntimeError("DMuonLoadPlanner needs the checkpoint metadata")
        problems, unexplained = self._problems(self.checkpoint.state_dict_metadata)
        state = compat.planner_flat_state(self)
        if problems and self.partial:
            self.skipped = sorted(problems)
            log.warning("partial load: skipping %d entries:\n  %s", len(problems), "\n  ".join(problems.values()))
            for fqn in problems:
                state.pop(fqn, None)
        # (without a partial load the coordinator refuses it all: nothing of this plan is read)
        fitting = {fqn: value for fqn, value in state.items() if fqn not in problems}
        # (over the chunks this rank's tensors overlap: not the world's, where the index says so)
        plan = create_default_local_load_plan(fitting, narrowed(self.checkpoint, fitting), strict=True)
        return dataclasses.replace(plan, planner_data=_Findings(list(problems.values()), unexplained))

    def needs_global_check(self, plan: LoadPlan) -> bool:
        """Must the coordinator see every rank's plan to judge it? Only where this rank found a
        problem or a checkpoint key it cannot explain (another rank may hold it); otherwise
        every rank's plan is valid on its own and needs no gather (``load_protocol.py``)."""
        found = plan.planner_data
        return isinstance(found, _Findings) and bool(found.problems or found.unexplained)

    def local_final_plan(self, plan: LoadPlan) -> LoadPlan:
        """This rank's plan as the coordinator would return it, when nothing needs checking."""
        return dataclasses.replace(plan, planner_data=None)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """Every rank's problems, and the keys of a checked section that no rank holds or
        knows (the model is not the one saved), in one error before anything is read."""
        findings = [
            plan.planner_data if isinstance(plan.planner_data, _Findings) else _Findings([], []) for plan in global_plan
        ]
        problems = list(dict.fromkeys(problem for found in findings for problem in found.problems))
        unwanted = set.intersection(*(set(found.unexplained) for found in findings)) if findings else set()
        extra = [f"{fqn}: in the checkpoint but not in the model/optimizer being loaded" for fqn in sorted(unwanted)]
        if (problems or extra) and not self.partial:
            raise CheckpointMismatchError(problems + extra)
        if extra:
            log.warning("partial load: %d checkpoint entries not loaded:\n  %s", len(extra), "\n  ".join(extra))
        return super().create_global_plan([dataclasses.replace(plan, planner_data=None) for plan in global_plan])

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Non-tensor entries: plain data only, never arbitrary objects.
        obj = torch.load(value, weights_only=True)
        path = compat.planner_mappings(self)[read_item.dest_index.fqn]
        compat.set_element(compat.planner_nested_state(self), path, obj)


def _mismatch(fqn: str, want: tuple[tuple, torch.dtype] | None, md, cast_dtypes: bool = False) -> str | None:
    """Why the stored entry ``md`` cannot fill a state-dict entry like ``want`` (None: a
    non-tensor), or None if it can (``cast_dtypes``: from one floating-point dtype to another)."""
    if md is None:
        return f"{fqn}: missing from the checkpoint"
    if want is None:
        return (
            None
            if isinstance(md, BytesStorageMetadata)
            else f"{fqn}: the checkpoint holds a tensor, the state dict an object"
        )
    if not isinstance(md, TensorStorageMetadata):
        return f"{fqn}: the checkpoint holds an object, the state dict a tensor"
    shape, dtype = want
    if tuple(md.size) != shape:
        problem = f"{fqn}: shape {tuple(md.size)} in the checkpoint, {shape} in the model"
        if md.size.numel() == 0 and torch.Size(shape).numel() != 0:
            problem += (
                " (the checkpoint holds an empty tensor where the model has a weight: the save that wrote "
                "it lost the weight (a dmuon dedicated weight saved from its placeholder?), so this "
                "checkpoint cannot restore it)"
            )
        return problem
    if md.properties.dtype != dtype:
        castable = md.properties.dtype.is_floating_point and dtype.is_floating_point
        if castable and cast_dtypes:
            return None
        stored, wanted = _describe_dtype(md.properties.dtype), _describe_dtype(dtype)
        hint = " (cast_dtypes=True casts it)" if castable else ""
        return f"{fqn}: dtype {stored} in the checkpoint, {wanted} in the model{hint}"
    return None
