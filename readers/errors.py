"""The readers' one error type: every failure to parse a local shard file is a :class:`ReaderError`.

Subclasses say more (:class:`UnknownFormatError`: a format name that is not registered). A
``ReaderError`` is a :class:`ValueError` (as it always was). ``datacache.ReaderError`` subclasses
it and names the shard's URL; this package never imports ``datacache``. Pure and thread-safe.
"""
from __future__ import annotations

import os
from typing import Any

__all__ = ["ReaderError", "UnknownFormatError", "RefusedContentError", "HINT_FORMAT", "HINT_CORRUPT"]

HINT_FORMAT = "Check the dataset's 'format' in manifest.json"  # a file of another format
HINT_CORRUPT = "The file is truncated or corrupt; delete it so the cache fetches it again"


class ReaderError(ValueError):
    """A local shard file cannot be parsed: wrong format, truncated, corrupt or hostile.

    ``path`` is the file concerned and ``hint`` says what to do; both appear in the message,
    e.g. ``"/x/a.tar: not a tar shard (bad header at offset 0). Check the dataset's 'format'
    in manifest.json"``.
    """

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None,
                 hint: str | None = None) -> None:
        self.message = message  # without path and hint, for callers that name the file their way
        self.path = None if path is None else os.fspath(path)
        self.url = self.path  # same attribute name as datacache.errors.DatacacheError
        self.hint = hint
        text = message
        if self.path is not None and not message.startswith(self.path):
            text = f"{self.path}: {message}"
        if hint:
            text = f"{text.rstrip('.')}. {hint}"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:  # keep path/hint across pickling (DataLoader)
        return (_rebuild_error, (type(self), str(self), self.path, self.hint, self.message))


def _rebuild_error(cls: type[ReaderError], text: str, path: str | None,
                   hint: str | None, message: str | None = None) -> ReaderError:
    err = cls.__new__(cls)
    ValueError.__init__(err, text)
    err.message = text if message is None else message
    err.path = err.url = path
    err.hint = hint
    return err


class UnknownFormatError(ReaderError):
    """A shard format name that is not registered (e.g. a manifest's ``format``)."""


class RefusedContentError(ReaderError):
    """A shard holds values the reader decodes only when told to: pickled values (another library's
    files), since unpickling runs whatever code the file's writer put there. The message says how."""
