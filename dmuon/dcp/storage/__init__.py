"""Where a checkpoint's bytes live: the :class:`Store` interface and its backends.

==================  ===========================================================================
``base``            the ``Store`` protocol (every operation a checkpoint needs), safe file names
``registry``        which backend serves a path or URL (by scheme); ``register_store``
``retry``           ``RetryPolicy`` and ``retrying``: a whole operation redone after a
                    transient failure
``local``           ``LocalStore``: a directory on a local or network filesystem, fsynced
``direct_io``       ``DirectFile``: writes past the page cache, from the caller's memory
``write_behind``    buffered writes whose writeback starts while the file is written
``write_path``      direct or buffered writes for a filesystem: the rule, logged once
``fsspec_store``    ``FsspecStore``: S3, GCS and everything else fsspec reaches
``s3_transfer``     S3 writes with several parts in flight (and their throttling retries)
``ranged_reader``   S3 and GCS reads: ranged GETs of what the reader will need, several in flight
==================  ===========================================================================

Nothing here knows of models, DCP or the checkpoint format. The package itself offers the
interface only; paths and URLs are understood in ``registry`` alone, so that code which works
with a store it is given (the checkpoint format, for one) never pulls in the backends.
"""

from .base import BorrowingStream, Store, checked_name
from .retry import RetryPolicy, retrying

__all__ = ["BorrowingStream", "RetryPolicy", "Store", "checked_name", "retrying"]
