"""Abstract shard reader/writer and the shard format record.

A :class:`ShardReader` turns one *local* shard file into samples (``dict`` field -> value). It
knows nothing of caches or networks. A :class:`ShardWriter` produces such a file from samples.

Thread safety: a reader or writer object is **not** thread-safe; use one reader per thread (or
guard it with a lock). Readers are fork-safe: every public read re-checks ``os.getpid()`` and
reopens its file handles, mmaps or LMDB environment in a forked child (e.g. a DataLoader worker),
so a reader opened in the parent can be used in the child. Readers also pickle (the handles are
dropped and reopened lazily), so they work with the ``spawn`` start method too.

Samples are writable, and an in-place change to one never reaches the file: arrays view writable
memory (a copy-on-write mapping, a pooled decompression buffer, or a copy of the row/member).
Each :meth:`ShardReader.iter_range` decodes afresh, so a change shows in no later run; only
``get`` of the same sample again, while its block is still the reader's current one, sees it.
"""
from __future__ import annotations

import abc
import bisect
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .codec import Sample, Schema, check_sample, check_schema, owned
from .errors import ReaderError

__all__ = ["ReaderError", "ShardReader", "ShardWriter", "ShardFormat", "ShardLayout", "Sample", "Schema"]


class ShardReader(abc.ABC):
    """Random and sequential access to the samples of one local shard file.

    Subclasses implement :meth:`_open_handles`, :meth:`_close_handles`, :meth:`__len__` and
    :meth:`_get`, and may override :meth:`_iter_range` with a faster sequential path and
    :meth:`_get_many` with a faster path for many sorted indices. They list
    the attributes holding OS resources in ``_HANDLE_ATTRS`` (dropped when pickled).
    Not thread-safe: use one reader per thread.
    """

    _HANDLE_ATTRS: tuple[str, ...] = ()

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path: str = os.fspath(path)
        self.schema: Schema | None = None
        self._pid: int | None = None
        self._closed = False

    # -- subclass hooks -------------------------------------------------------------------
    @abc.abstractmethod
    def _open_handles(self) -> None:
        """Open file handles/mmaps/environments (called at open and again after a fork)."""

    @abc.abstractmethod
    def _close_handles(self) -> None:
        """Release what :meth:`_open_handles` opened; must tolerate partly opened state."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of samples in the shard."""

    @abc.abstractmethod
    def _get(self, index: int) -> Sample:
        """Return sample ``index`` (already bounds-checked, handles open)."""

    def _iter_range(self, start: int, stop: int) -> Iterator[Sample]:
        """Yield samples ``start..stop-1`` (already bounds-checked, handles open)."""
        for i in range(start, stop):
            yield self._get(i)

    # -- public API -----------------------------------------------------------------------
    def _ensure_open(self) -> None:
        """Open handles on first use, and reopen them in a forked child."""
        if self._closed:
            raise ReaderError("reader is closed", path=self.path, hint="Open the shard again")
        pid = os.getpid()
        if self._pid == pid:
            return
        if self._pid is not None:  # inherited from the parent: never share its handles
            self._close_handles()
        self._pid = None
        try:
            self._open_handles()
        except BaseException:
            self._close_handles()
            raise
        self._pid = pid

    def _check_index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, int):
            try:
                index = index.__index__()  # numpy integers
            except AttributeError:
                raise TypeError(f"sample index must be an int, not {type(index).__name__}") from None
        n = len(self)
        if not 0 <= index < n:
            raise IndexError(f"{self.path}: sample index {index} out of range [0, {n})")
        return index

    def get(self, index: int) -> Sample:
        """Return sample ``index`` (``0 <= index < len(self)``, else :class:`IndexError`)."""
        index = self._check_index(index)
        self._ensure_open()
        return self._get(index)

    __getitem__ = get

    def get_many(self, indices: list[int], *, copy: bool = False) -> list[Sample]:
        """The samples at ``indices`` (sorted, each in range, else :class:`IndexError`), in that
        order: what many ``get`` calls return, with the format's faster path where it has one
        (each block decoded once per call). ``copy``: samples that a caller may keep past the next
        read and the reader's close: memory of their own, or views of a file mapping that no read
        changes and that outlives the reader (``readers._cowmap``), never of a buffer it reuses."""
        n = len(self)
        if indices and not (0 <= indices[0] and indices[-1] < n):
            raise IndexError(f"{self.path}: sample indices {indices[0]}..{indices[-1]} outside [0, {n})")
        self._ensure_open()
        return self._get_many(indices, copy)

    def _get_many(self, indices: list[int], copy: bool) -> list[Sample]:
        """``get_many`` with checked, sorted ``indices`` and handles open."""
        if copy:
            return [owned(self._get(i)) for i in indices]
        return [self._get(i) for i in indices]

    def iter_range(self, start: int = 0, stop: int | None = None) -> Iterator[Sample]:
        """Yield samples ``start..stop-1`` in order (empty when ``stop <= start``).

        ``start``/``stop`` must lie in ``[0, len(self)]`` (else :class:`IndexError`). This is
        the fast sequential path: each block/row group is decoded once.
        """
        n = len(self)
        stop = n if stop is None else stop
        if not (0 <= start <= n and 0 <= stop <= n):
            raise IndexError(f"{self.path}: range [{start}, {stop}) outside [0, {n}]")
        return self._iter_checked(start, stop)

    def _iter_checked(self, start: int, stop: int) -> Iterator[Sample]:
        if stop <= start:
            return
        self._ensure_open()
        yield from self._iter_range(start, stop)

    def __iter__(self) -> Iterator[Sample]:
        return self.iter_range(0, len(self))

    def prepare_tables(self) -> None:
        """Make now what this reader's later columnar reads (a format's ``columns``) take their rows
        from, where the format keeps such a thing: called on a reader kept open across reads
        (``datacache.read.open_readers``), whose file never changes, when it is handed out again
        for a caller that will read it as tables. A hint: it may do nothing, and a read never needs
        it. The base reader keeps nothing."""
        return None

    def field_kinds(self) -> Schema:
        """The schema a manifest records for this file: :attr:`schema`, or for a file without
        one, the kinds its fields come back as (see the format's reader)."""
        return dict(self.schema or {})

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._closed

    def close(self) -> None:
        """Release the file handles; idempotent. The reader cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._pid is not None:
            self._close_handles()
        self._pid = None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self._HANDLE_ATTRS:
            state[name] = None
        state["_pid"] = None
        return state

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} samples"
        return f"<{type(self).__name__} {self.path!r} {state}>"


class ShardWriter(abc.ABC):
    """Write samples matching ``schema`` into one shard file at ``path``.

    The file is written under a temporary name (``path + ".partial"``) and renamed into place
    by :meth:`close`, so ``path`` only ever holds a complete shard. Used as a context manager,
    an exception inside the ``with`` block aborts the shard (the partial file is removed).
    Not thread-safe.
    """

    def __init__(self, path: str | os.PathLike[str], schema: Schema) -> None:
        self.path: str = os.fspath(path)
        self.schema: Schema = check_schema(schema)
        self.tmp_path: str = self.path + ".partial"
        self._bytes = 0
        self._count = 0
        self._closed = False

    @abc.abstractmethod
    def _write(self, sample: Sample) -> int:
        """Write one checked sample; return its payload size in bytes."""

    @abc.abstractmethod
    def _finish(self) -> None:
        """Flush and finish the file at ``tmp_path`` (it is renamed afterwards)."""

    @abc.abstractmethod
    def _discard(self) -> None:
        """Release handles without finishing (abort)."""

    def write(self, sample: Sample) -> None:
        """Append one sample; raises :class:`ValueError`/:class:`TypeError` if it does not
        match the schema."""
        if self._closed:
            raise ValueError(f"{self.path}: writer is closed")
        check_sample(sample, self.schema)
        self._bytes += self._write(sample)
        self._count += 1

    @property
    def bytes_written(self) -> int:
        """Encoded payload bytes of the samples written so far (before compression)."""
        return self._bytes

    @property
    def samples_written(self) -> int:
        """Number of samples written so far."""
        return self._count

    @property
    def unit_rows(self) -> tuple[int, ...]:
        """Samples per whole unit (``ShardLayout``) written so far, the shard's last unit not
        counted (it is cut short by the shard's end); empty for a format without units."""
        return ()

    def close(self) -> None:
        """Finish the shard and move it to ``path``; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish()
        except BaseException:
            self._discard()
            _remove(self.tmp_path)
            raise
        os.replace(self.tmp_path, self.path)

    def abort(self) -> None:
        """Drop the shard being written (removes the partial file); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._discard()
        _remove(self.tmp_path)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


ReadRange = Callable[[int, int], bytes]  # (start, end) -> those bytes of a file, e.g. a range read
Probe = Callable[[ReadRange, int, str], "tuple[int, Schema] | None"]


@dataclass(frozen=True)
class ShardLayout:
    """Where a shard file's samples lie, so that a reader can serve some samples of a file of which
    only some byte ranges are present (the others may hold anything). Immutable.

    ``fixed``: the byte ranges ``(start, end)`` every read needs (header, index, footer).
    ``spans``: per *unit* (a format's smallest independently readable piece: a dcz block) its
    byte range, in file order. ``first``: per unit its first sample; unit ``u`` holds samples
    ``first[u] .. first[u + 1] - 1`` (the last up to ``samples - 1``).
    """

    size: int
    samples: int
    fixed: tuple[tuple[int, int], ...]
    spans: tuple[tuple[int, int], ...]
    first: tuple[int, ...]

    def units_of(self, lo: int, hi: int) -> range:
        """The units holding samples ``lo .. hi - 1`` (empty for ``lo >= hi``)."""
        if not 0 <= lo <= hi <= self.samples:
            raise ValueError(f"samples [{lo}, {hi}) not within [0, {self.samples})")
        if lo == hi:
            return range(0)
        return range(bisect.bisect_right(self.first, lo) - 1, bisect.bisect_right(self.first, hi - 1))

    def units_of_rows(self, rows: list[int]) -> list[int]:
        """The units holding the samples ``rows`` (sorted, each in range), ascending, once each."""
        if rows and not 0 <= rows[0] <= rows[-1] < self.samples:
            raise ValueError(f"rows {rows[0]}..{rows[-1]} not within [0, {self.samples})")
        out: list[int] = []
        for r in rows:
            u = bisect.bisect_right(self.first, r) - 1
            if not out or out[-1] != u:
                out.append(u)
        return out


Layout = Callable[[ReadRange, int, str], ShardLayout]


@dataclass(frozen=True)
class ShardFormat:
    """A registered shard format: ``open(path, **kw)`` and ``ShardWriter(path, schema, **kw)``.

    ``probe(read_range, size, name)``, where a format has one, checks a file that is not local
    (a remote object) with a few range reads: it returns ``(samples, schema)`` when they can be
    told without reading the whole file (Parquet's footer), else None, and raises
    :class:`ReaderError` naming ``name`` when the file is not of this format.
    ``layout(read_range, size, name)``, where a format has one, reads (with a few range reads) and
    validates where a file's samples lie: a :class:`ShardLayout`, so that a cache may fill a file
    unit by unit and read samples from it before it is whole. ``union_schema``:
    samples may lack some fields (WebDataset tars), so a dataset's schema is the union of its
    files' schemas rather than one schema they all share. ``writes``: false for a format datacache
    reads in place but does not write (another library's files); its ``ShardWriter`` refuses.
    """

    name: str
    extension: str
    reader: Callable[..., ShardReader]
    ShardWriter: Callable[..., ShardWriter]
    probe: Probe | None = None
    union_schema: bool = False
    layout: Layout | None = None
    writes: bool = True

    def open(self, path: str | os.PathLike[str], **kw: Any) -> ShardReader:
        """Open ``path`` as a shard of this format (raises :class:`ReaderError`)."""
        return self.reader(path, **kw)
