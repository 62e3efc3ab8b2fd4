"""The store layer: object storage access behind one small API.

Guarantees:
- the only layer that imports fsspec (and, through it, s3fs, gcsfs, adlfs);
- every backend error is translated where it enters into one exception of :mod:`datacache.errors`
  (``raise ... from exc``), transient ones retried within ``RetryConfig``'s deadlines;
- every process of a node backs off together from a throttling or failing store (``congestion``);
- a process forked from one holding a ``Store`` reopens its connections and never closes the parent's.

May import: the base modules (``datacache.config``, ``errors``, ``_localfs``). Never ``cache``,
``plan``, ``read`` or anything above them.

Advanced API: ``Store`` and ``open_store`` (also exported by ``datacache``).
"""
from .storage import Store, open_store

__all__ = ["Store", "open_store"]
