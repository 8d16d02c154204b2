"""``planner_data``'s flatten mappings in a compact form, for the two encodings of ``Metadata``
that travel or are stored beside ``.metadata`` (``metadata_wire.py``, ``sharding_index.py``).

DCP's flattening records, per key, the path of the value in the nested state dict; for almost
every key it is the key itself split at its dots. Pickled, that is every part of every key
once more; said as the lengths of the parts, it is a few bytes a key.
"""

from __future__ import annotations

from array import array
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["joined_mappings", "split_mappings"]


def split_mappings(metadata: Metadata) -> tuple[list[Any], Any]:
    """``planner_data``'s flatten mappings, one per key: the lengths of the key's parts where
    the mapping is the key split at its dots (each part a string), else the mapping itself (or
    None: no mapping); and the rest of ``planner_data`` as it is."""
    planner = metadata.planner_data
    if not isinstance(planner, dict):
        return [], planner
    rest = dict(planner)
    out: list[Any] = []
    for fqn in metadata.state_dict_metadata:
        path = rest.pop(fqn, None)
        if isinstance(path, tuple) and path and all(isinstance(part, str) for part in path) and ".".join(path) == fqn:
            out.append(array("H", [len(part) for part in path]).tobytes() if max(map(len, path)) < 1 << 16 else path)
        else:
            out.append(path)
    return out, rest


def joined_mappings(keys: list[str], mappings: list[Any], rest: Any) -> Any:
    """The ``planner_data`` that :func:`split_mappings` split, for the keys ``keys``."""
    if not isinstance(rest, dict):
        return rest
    planner: dict[str, Any] = {}
    for fqn, mapping in zip(keys, mappings):
        if isinstance(mapping, bytes):
            lengths = array("H")
            lengths.frombytes(mapping)
            parts, at = [], 0
            for length in lengths:
                parts.append(fqn[at : at + length])
                at += length + 1
            planner[fqn] = tuple(parts)
        elif mapping is not None:
            planner[fqn] = mapping
    planner.update(rest)
    return planner
