"""Shard readers and writers, one module per shard format, and the format registry.

A reader turns a *local* shard file into samples (``dict`` field -> value) and knows nothing of
caches or networks. Each format object in :data:`FORMATS` has ``name``, ``extension``,
``open(path, **kw) -> ShardReader`` and ``ShardWriter(path, schema, **kw)``, and may have
``probe`` (a cheap check of a remote file through range reads; see :class:`readers.base.ShardFormat`).
Every failure to read a file is a :class:`ReaderError` (:mod:`readers.errors`). Imports go one way:
``errors`` <- ``codec`` <- ``base`` <- the format modules <- this package; never ``datacache``.

Built-in formats: ``zstd`` (``.dcz``, native), ``parquet`` (``.parquet``), ``lmdb``
(``.lmdb``) and ``tar`` (``.tar``, WebDataset layout); read in place only: ``mds`` (MosaicML
Streaming), ``litdata`` (LitData chunks) and ``arrow`` (Hugging Face ``save_to_disk`` files).

The registry is meant to be filled at import time; :func:`register_format` is not thread-safe.
Readers and writers: one object per thread (see :mod:`readers.base`).
"""
from __future__ import annotations

import os
from typing import Any

from . import arrow as _arrow
from . import codec
from . import litdata as _litdata
from . import lmdb as _lmdb
from . import mds as _mds
from . import parquet as _parquet
from . import tar as _tar
from . import zstd as _zstd
from .base import ShardFormat, ShardReader, ShardWriter
from .errors import ReaderError, RefusedContentError, UnknownFormatError

__all__ = [
    "FORMATS", "UnknownFormatError", "ReaderError", "RefusedContentError", "ShardReader", "ShardWriter", "ShardFormat",
    "register_format", "get_format", "open_shard", "codec",
]


FORMATS: dict[str, Any] = {}

_REQUIRED = ("name", "extension", "open", "ShardWriter")


def register_format(name: str, fmt: Any, *, replace: bool = False) -> None:
    """Register ``fmt`` (an object with ``name``, ``extension``, ``open``, ``ShardWriter``).

    Raises :class:`ValueError` if ``name`` is taken by another object and ``replace`` is false.
    """
    missing = [attr for attr in _REQUIRED if not hasattr(fmt, attr)]
    if missing:
        raise TypeError(f"format {name!r} lacks {missing}; a format needs {list(_REQUIRED)}")
    if not replace and FORMATS.get(name, fmt) is not fmt:
        raise ValueError(f"format {name!r} is already registered; pass replace=True")
    FORMATS[name] = fmt


def get_format(name: str) -> Any:
    """Return the format registered as ``name``, else :class:`UnknownFormatError`."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(FORMATS))
        raise UnknownFormatError(f"unknown shard format {name!r}; known formats: {known}") \
            from None


def open_shard(format_name: str, path: str | os.PathLike[str], **kw: Any) -> ShardReader:
    """Open the local shard ``path`` with the reader of ``format_name``."""
    return get_format(format_name).open(path, **kw)


for _fmt in (_zstd.FORMAT, _parquet.FORMAT, _lmdb.FORMAT, _tar.FORMAT, _mds.FORMAT, _litdata.FORMAT, _arrow.FORMAT):
    register_format(_fmt.name, _fmt)
del _fmt
