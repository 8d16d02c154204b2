"""The dmuon checkpoint format: every name and key layout a reader or writer relies on.

A dmuon checkpoint is a standard DCP checkpoint directory (or object-store prefix):

* ``.metadata`` -- torch's pickled ``Metadata``; written last, it is the commit marker.
  ``Metadata.planner_data[RESERVED_KEY]`` holds dmuon's own description (format version,
  topology at save, owner and writer of every dedicated tensor, tied aliases).
* ``__<rank>_<save id>.distcp`` -- one data file per rank that had something to write: the
  items of its write plan end to end, each a ``torch.save`` payload (tensors) or raw bytes.
* ``.dmuon-manifest-<save id>.json`` -- sizes and checksums of every data file and item and of
  the ``.metadata`` bytes (see ``integrity.py`` for its schema).

State-dict keys, after DCP's flattening (``AppState``):

* ``model.<fqn>`` -- every parameter and persistent buffer, full logical shape;
* ``optim.state.<fqn>.<name>`` -- optimizer state (``dmuon.optim.muon.STATE_FIELDS``);
* ``optim.param_groups.<group name>.<hyper-parameter>``;
* ``extra.*`` -- whatever the caller passed.
"""
from __future__ import annotations

#: Key of dmuon's entry in ``Metadata.planner_data`` and of the dedicated-tensor layout that
#: ``AppState`` puts next to its sections.
RESERVED_KEY = "__dmuon__"
#: Version of what dmuon records under ``RESERVED_KEY``.
FORMAT_VERSION = 1

MODEL_SECTION = "model"
OPTIM_SECTION = "optim"
EXTRA_SECTION = "extra"
MODEL_PREFIX = MODEL_SECTION + "."
OPTIM_PREFIX = OPTIM_SECTION + "."
