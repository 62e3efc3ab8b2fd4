"""One documented exception hierarchy for datacache.

Every error names the URL or path it concerns, says what was expected, and what to do::

    DatacacheError                  base class; ``.url`` is the URL or path concerned (may be None)
    +-- StorageError                the object store could not serve a request
    |   +-- TransientStorageError   5xx, refused or reset connections, timeouts: retries were exhausted
    |   |   +-- ThrottledError      the store kept throttling (503 SlowDown, 429...) until the deadline
    |   |   +-- UnreachableError    a store that never answered refuses connections or its host name
    |   |                           does not resolve (a typo in the endpoint?): RetryConfig.connect_deadline
    |   +-- NotFoundError           404, no such bucket or key (also a FileNotFoundError)
    |   +-- PermissionDeniedError   403, missing or wrong credentials (also a PermissionError)
    |   +-- ReadCancelledError      a read its caller abandoned (Ctrl-C, closed prefetcher): not retried
    +-- ManifestError               manifest.json missing, truncated, invalid, or naming unsafe shards
    +-- IntegrityError              bytes do not match the size or hash the manifest declares
    +-- ReaderError                 a local shard file cannot be parsed by its reader (wrong format,
    |                               truncated, hostile: oversized declarations, bombs, unsafe members);
    |                               also a ``readers.ReaderError``, the readers' own base class
    +-- CacheError                  a cache directory is unusable (not ours, wrong mode, no space)
    +-- DatasetExistsError          a write would replace a dataset without overwrite=True / --force
                                    (also a FileExistsError)

Backend errors are translated where they enter (``raise ... from exc``), so the original cause
stays chained in ``__cause__``. Credentials never appear in messages. Reader failures enter at the
one shard path (``datacache.read.shard_source``), which turns every ``readers.ReaderError`` into a
``datacache.ReaderError`` naming the shard's URL; ``except datacache.ReaderError`` and ``except
datacache.DatacacheError`` therefore catch every reader failure from every entry point.
"""
from __future__ import annotations

from typing import Any

from .readers import ReaderError as _ShardReaderError

__all__ = [
    "DatacacheError",
    "StorageError",
    "TransientStorageError",
    "ThrottledError",
    "UnreachableError",
    "NotFoundError",
    "PermissionDeniedError",
    "ReadCancelledError",
    "ManifestError",
    "IntegrityError",
    "ReaderError",
    "CacheError",
    "DatasetExistsError",
]


class DatacacheError(Exception):
    """Base of every datacache error. ``url`` is the URL or local path concerned."""

    def __init__(self, message: str, *, url: str | None = None, hint: str | None = None) -> None:
        self.url = url
        self.hint = hint
        text = message if url is None or url in message else f"{url}: {message}"
        if hint:
            text = f"{text}. {hint}" if not text.endswith(".") else f"{text} {hint}"
        super().__init__(text)


class StorageError(DatacacheError):
    """The object store could not serve a request."""


class TransientStorageError(StorageError):
    """A retryable failure (5xx, throttling, connection reset, timeout) that outlasted the retries."""


class ThrottledError(TransientStorageError):
    """The store kept answering "slow down" (503 SlowDown, 429, RequestLimitExceeded...) until the
    retry deadline: lower the request rate (``TransferConfig.max_requests_per_s``) or raise it."""


class UnreachableError(TransientStorageError):
    """A store that has never answered refused the connection or its host name did not resolve
    until ``RetryConfig.connect_deadline``: the endpoint is wrong or the store is not running."""


class NotFoundError(StorageError, FileNotFoundError):
    """The bucket, prefix or object does not exist. ``code`` is the store's error code where it gave
    one (``"NoSuchBucket"``), else None."""

    code: str | None = None


class PermissionDeniedError(StorageError, PermissionError):
    """The store refused access: missing or wrong credentials, or no permission."""


class ReadCancelledError(StorageError):
    """A read abandoned because its caller cancelled it (Ctrl-C, a closed prefetcher, a dead parent)."""


class ManifestError(DatacacheError):
    """manifest.json is missing, truncated, invalid, or names an unsafe shard."""


class IntegrityError(DatacacheError):
    """Bytes do not match the size or content hash declared in the manifest."""


class ReaderError(DatacacheError, _ShardReaderError):
    """A local shard file cannot be parsed by its reader (also a ``readers.ReaderError``)."""

    def __init__(self, message: str, *, url: str | None = None, hint: str | None = None) -> None:
        DatacacheError.__init__(self, message, url=url, hint=hint)  # the readers' ReaderError.__init__ runs
        self.url, self.hint, self.path = url, hint, url  # inside it (MRO) and resets these

    def __reduce__(self) -> tuple[Any, ...]:  # keep url/hint across pickling (DataLoader workers)
        return (_rebuild, (type(self), str(self), self.url, self.hint))


def _rebuild(cls: type[DatacacheError], text: str, url: str | None, hint: str | None) -> DatacacheError:
    err = cls.__new__(cls)
    Exception.__init__(err, text)
    err.url, err.hint = url, hint
    if isinstance(err, ReaderError):
        err.path = url
    return err


class CacheError(DatacacheError):
    """A cache directory is unusable."""


class DatasetExistsError(DatacacheError, FileExistsError):
    """The URL already holds a dataset and the write was not asked to replace it (overwrite=True)."""
