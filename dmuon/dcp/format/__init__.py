"""The checkpoint format: what each file of a checkpoint holds, byte by byte.

==================  ===========================================================================
``layout``          every file name and key prefix of a checkpoint; the format's description
``manifest``        the checksum manifest (schema version 3; 1 and 2 still read)
``checksums``       the checksum kinds a manifest can name
``safe_metadata``   unpickling ``.metadata`` with an allow-list
``torch_file``      tensors in the ``torch.save`` format (pickle, frames, payloads)
``torch_zip``       the zip container of a ``torch.save`` file
``tensor_bytes``    a tensor's bytes without copies, written in bounded slices
``safetensors_file``  the safetensors format, read and written; HuggingFace's file layout
``verified_read``   reading items, byte ranges and whole files, checked against the manifest
==================  ===========================================================================

Nothing here knows of models or planners; bytes come and go through ``storage`` stores. The
names of :mod:`.layout` are importable from this package too (``dmuon.dcp.format.METADATA``).
"""

from . import layout
from .layout import *  # noqa: F403 - the layout's names are the package's own

__all__ = layout.__all__
