"""The dmuon checkpoint format: every file name and key layout a reader or writer relies on.

Everything that names a file or a key is defined here and imported elsewhere.

A dmuon checkpoint is a standard DCP checkpoint, one directory (or object-store prefix):

``.metadata``
    torch's pickled ``Metadata``. Written last, atomically: it is the commit marker, and a
    directory without it is an incomplete save. ``Metadata.planner_data[RESERVED_KEY]`` holds
    dmuon's description of the save (:data:`FORMAT_VERSION`, topology, the owner and writer of
    every dedicated tensor, tied aliases).
``__<rank>_<save id>.distcp`` (or ``<hex>-__<rank>_<save id>.distcp``: key prefixes)
    one data file per rank that had something to write: the items of its write plan end to
    end, each a ``torch.save`` payload (tensors) or raw bytes (other objects), then the file's
    checksum trailer (``file_sums.py``). On a local disk
    written with direct I/O, a tensor of 1 MiB or more has zip padding before its bytes that
    puts them at a file offset congruent to their address in the writer's memory (modulo
    4096), so they were written from that memory; readers take every record's start from its
    header and need not know.
``.dmuon-manifest-<save id>.json``
    every data file's size and where its trailer starts, and the size and checksum of the
    ``.metadata`` bytes, itself checksummed; schema in ``manifest.py`` (earlier versions held
    every item's checksums here). Since issue 43 it also holds the *sharding index*: what
    ``.metadata`` says, by rules whose size does not grow with the ranks, which dmuon's loads
    read instead of unpickling ``.metadata`` (``sharding_index.py``).
``<one of the above>.tmp-<random>``
    a file being put atomically (written, then renamed or linked into place; the name is the
    store's, ``storage.base.temp_name``).

The save id is random per save and names the manifest. A data file's name carries the id of
the save that first wrote its layout: a later save of the same layout (the plan cache's steady
save) keeps the names, so its ``.metadata`` is the same bytes, in another directory; a save into
a directory that holds files of those names names its files with its own id, so files of a new
save never overwrite a committed one. Each file's trailer names the save that wrote it.

State-dict keys, after DCP's flattening of an ``AppState``:

* ``model.<fqn>`` -- every parameter and persistent buffer, full logical shape (a dedicated
  weight as one chunk, tied aliases once under the first name);
* ``optim.state.<fqn>.<name>`` -- optimizer state (names: ``dmuon.optim.state_fields.STATE_FIELDS``);
* ``optim.param_groups.<group name>.<hyper-parameter>``;
* ``extra.*`` -- whatever the caller passed.

Checkpoint *roots* (``CheckpointManager``, the tiers of ``TieredCheckpointManager``) hold one
directory per step, ``step-<N>`` (:func:`step_dir_name`). A node-local tier root also holds
``peer-<node>/step-<N>``: the data files (and a copy of the manifest and ``.metadata``) of
another node's part of step N, replicated here; and, while a restore runs,
``restore-view/``: every file of the step being restored, as links to the copies this node
holds or as sparse files holding only the byte ranges this node's ranks read, fetched from a
peer. A node's own ``step-<N>`` holds the data files of its ranks, with the manifest and
``.metadata`` of the whole step (node 0's are the commit; the others are copies of them).

A HuggingFace export is ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` plus
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``); given the model's
config, also ``config.json`` (its dtype field set to the exported dtype) and
``generation_config.json`` when the config came with one (``dcp/hf_config.py``).
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence
from typing import overload

from ..storage.base import temp_target

__all__ = [
    "EXTRA_SECTION",
    "FORMAT_VERSION",
    "HF_CONFIG_FILE",
    "HF_GENERATION_CONFIG_FILE",
    "HF_INDEX_FILE",
    "HF_SINGLE_FILE",
    "MAX_KEY_PREFIXES",
    "METADATA",
    "MODEL_PREFIX",
    "MODEL_SECTION",
    "OPTIM_SECTION",
    "RESERVED_KEY",
    "RESTORE_VIEW_DIR",
    "data_file_name",
    "data_file_of",
    "hf_shard_name",
    "is_dmuon_file",
    "is_manifest_name",
    "manifest_name",
    "node_of_peer_dir",
    "peer_dir_name",
    "rank_of_data_file",
    "save_id_of_data_file",
    "step_dir_name",
    "step_of_dir",
]

#: The commit marker (torch's metadata file name).
METADATA = ".metadata"
#: Key of dmuon's entry in ``Metadata.planner_data``, and of the dedicated-tensor layout an
#: ``AppState`` puts next to its sections.
RESERVED_KEY = "__dmuon__"
#: Version of what dmuon records under ``RESERVED_KEY``.
FORMAT_VERSION = 1

MODEL_SECTION = "model"
OPTIM_SECTION = "optim"
EXTRA_SECTION = "extra"
MODEL_PREFIX = MODEL_SECTION + "."

_DATA_FILE = re.compile(r"^(?:[0-9a-f]{1,4}-)?__(\d+)_([0-9A-Za-z]+)\.distcp$")
#: The most key prefixes a save may spread its data files over (4 hex digits).
MAX_KEY_PREFIXES = 1 << 16
_MANIFEST_PREFIX = ".dmuon-manifest-"
_MANIFEST_FILE = re.compile(r"^\.dmuon-manifest-([0-9a-f]+)\.json$")

_STEP_DIR = re.compile(r"^step-(\d+)$")
_PEER_DIR = re.compile(r"^peer-(\d+)$")
#: Where a node-local tier assembles the step being restored (removed afterwards).
RESTORE_VIEW_DIR = "restore-view"

HF_SINGLE_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
#: The model's HuggingFace config, and its generation config, beside the weights of an export.
HF_CONFIG_FILE = "config.json"
HF_GENERATION_CONFIG_FILE = "generation_config.json"


def data_file_name(rank: int, save_id: str, key_prefixes: int = 0) -> str:
    """Rank ``rank``'s data file of save ``save_id``. With ``key_prefixes`` (2 or more), the
    name starts with one of that many hex prefixes, ``<prefix>-``, taken round-robin by rank:
    the ranks' objects then spread evenly over key ranges an object store can serve apart
    (docs/checkpoint.md, "Key prefixes")."""
    if key_prefixes < 2:
        return f"__{rank}_{save_id}.distcp"
    if key_prefixes > MAX_KEY_PREFIXES:
        raise ValueError(f"key_prefixes must be at most {MAX_KEY_PREFIXES}, got {key_prefixes}")
    width = len(f"{key_prefixes - 1:x}")
    return f"{rank % key_prefixes:0{width}x}-__{rank}_{save_id}.distcp"


def rank_of_data_file(name: str) -> int | None:
    """The rank that wrote a data file, or None if ``name`` is not one."""
    match = _DATA_FILE.match(name)
    return int(match.group(1)) if match else None


def save_id_of_data_file(name: str) -> str | None:
    """The save id in a data file's name (that of the save that first wrote its layout)."""
    match = _DATA_FILE.match(name)
    return match.group(2) if match else None


def data_file_of(rank: int, names) -> str:
    """Rank ``rank``'s data file among ``names`` (a manifest's files), or "" where it wrote none.
    Its name carries the id of the save that first wrote its layout, not necessarily the id of
    the save the manifest commits (a steady save keeps its files' names)."""
    return next((name for name in names if rank_of_data_file(name) == rank), "")


class RankFileNames(Sequence[str]):
    """The data files' names of an index that names them by rank (:func:`data_file_name` of one
    save id): each name made when asked for, so that a rank whose load reads two files
    does not spell out all N (nor build N strings and a table of them)."""

    def __init__(self, save_id: str, ranks: array) -> None:
        self.save_id, self._ranks = save_id, ranks
        self._made: dict[int, str] = {}
        self._numbers: dict[int, int] | None = None  # rank -> position, where ranks are out of order

    def __len__(self) -> int:
        return len(self._ranks)

    @overload
    def __getitem__(self, f: int) -> str: ...

    @overload
    def __getitem__(self, f: slice) -> list[str]: ...

    def __getitem__(self, f: int | slice) -> str | list[str]:
        if isinstance(f, slice):
            return [self[k] for k in range(*f.indices(len(self)))]
        name = self._made.get(f)
        if name is None:
            name = self._made[f] = data_file_name(self._ranks[f], self.save_id)  # (IndexError past the end)
        return name

    def position(self, name: str) -> int | None:
        """Where ``name`` is in the table, or None."""
        if save_id_of_data_file(name) != self.save_id:
            return None
        rank = rank_of_data_file(name)
        if rank is None:
            return None
        if 0 <= rank < len(self._ranks) and self._ranks[rank] == rank:  # (in rank order, as dmuon writes them)
            f: int | None = rank
        else:
            if self._numbers is None:
                self._numbers = {r: k for k, r in enumerate(self._ranks)}
            f = self._numbers.get(rank)
        return f if f is not None and self[f] == name else None


def manifest_name(save_id: str) -> str:
    return f"{_MANIFEST_PREFIX}{save_id}.json"


def is_manifest_name(name: str) -> bool:
    return _MANIFEST_FILE.match(name) is not None


def is_dmuon_file(name: str) -> bool:
    """A file a dmuon save writes: data file, manifest, or a temporary one of .metadata or a
    manifest. Garbage collection never touches anything else."""
    if _DATA_FILE.match(name) or _MANIFEST_FILE.match(name):
        return True
    target = temp_target(name)
    return target is not None and (target == METADATA or _MANIFEST_FILE.match(target) is not None)


def step_dir_name(step: int) -> str:
    """The directory of one step under a checkpoint root."""
    return f"step-{step}"


def step_of_dir(name: str) -> int | None:
    """The step a directory under a checkpoint root holds, or None if ``name`` is not one."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def peer_dir_name(node: int) -> str:
    """The directory, under a node-local tier root, of the replicated parts of ``node``."""
    return f"peer-{node}"


def node_of_peer_dir(name: str) -> int | None:
    """The node whose replicated parts a directory holds, or None if ``name`` is not one."""
    match = _PEER_DIR.match(name)
    return int(match.group(1)) if match else None


def hf_shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"
