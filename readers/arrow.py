"""Arrow IPC stream files (a Hugging Face ``save_to_disk`` folder's ``data-*.arrow``), through pyarrow.

A file is a stream of record batches; the reader maps it and treats each batch as the Parquet
reader treats a row group: values come out as they do from a Parquet file without datacache
metadata (:mod:`readers.parquet`): ``to_pylist`` values, a fixed-size list of numbers as a writable
``ndarray``, a narrower float as a numpy scalar of its dtype. ``columns=[...]`` projects columns.

Not thread-safe: one reader per thread.
"""
from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa

from ._sampletable import no_writer
from .base import ShardFormat
from .base import ShardReader as _BaseReader
from .codec import Sample
from .errors import HINT_CORRUPT, HINT_FORMAT, ReaderError
from .parquet import _values, arrow_kind

__all__ = ["ArrowStreamReader", "FORMAT"]

_STREAM_MAGIC = b"\xff\xff\xff\xff"  # an IPC stream's first message starts with the continuation marker


class ArrowStreamReader(_BaseReader):
    """Read an Arrow IPC stream file through a memory map, one record batch at a time."""

    _HANDLE_ATTRS = ("_source", "_batches")

    def __init__(self, path: str | os.PathLike[str], *, columns: Sequence[str] | None = None) -> None:
        super().__init__(path)
        self._requested = None if columns is None else list(columns)
        self._source: Any = None
        self._batches: list[pa.RecordBatch] | None = None
        self._ends: np.ndarray | None = None
        self._cached: tuple[int, dict[str, list[Any]]] = (-1, {})
        self._ensure_open()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_cached"] = (-1, {})
        return state

    def _open_handles(self) -> None:
        with open(self.path, "rb") as f:
            head = f.read(4)
        if head != _STREAM_MAGIC:
            raise ReaderError(f"not an Arrow IPC stream (starts with {head!r})", path=self.path, hint=HINT_FORMAT)
        try:
            self._source = pa.memory_map(self.path, "r")
            reader = pa.ipc.open_stream(self._source)
            self._batches = list(reader)  # zero-copy: the batches view the map
            schema = reader.schema
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise ReaderError(f"truncated or corrupt Arrow stream ({exc})", path=self.path, hint=HINT_CORRUPT) from None
        ends = np.cumsum([b.num_rows for b in self._batches], dtype=np.int64)
        if self._ends is None:
            missing = [n for n in (self._requested or []) if n not in schema.names]
            if missing:
                raise ReaderError(f"Arrow stream has no column(s) {missing}", path=self.path,
                                  hint=f"Available columns: {schema.names}")
            names = self._requested if self._requested is not None else schema.names
            self.schema = {n: arrow_kind(schema.field(n).type) for n in names}
            self._ends = ends
        elif not np.array_equal(ends, self._ends):
            raise ReaderError("Arrow stream changed since it was opened", path=self.path, hint=HINT_CORRUPT)

    def _close_handles(self) -> None:
        self._batches = None
        if self._source is not None:
            self._source.close()
        self._source = None

    def __len__(self) -> int:
        assert self._ends is not None
        return int(self._ends[-1]) if len(self._ends) else 0

    def _batch(self, k: int) -> dict[str, list[Any]]:
        if self._cached[0] == k:
            return self._cached[1]
        assert self._batches is not None and self.schema is not None
        table = pa.Table.from_batches([self._batches[k]])
        try:
            columns = {n: _values(table.column(n), False) for n in self.schema}
        except (pa.ArrowException, ValueError) as exc:
            raise ReaderError(f"record batch {k} cannot be read ({exc})", path=self.path, hint=HINT_CORRUPT) from None
        self._cached = (k, columns)
        return columns

    def _start(self, k: int) -> int:
        assert self._ends is not None
        return int(self._ends[k - 1]) if k else 0

    def _get(self, index: int) -> Sample:
        assert self._ends is not None
        k = int(np.searchsorted(self._ends, index, side="right"))
        columns, local = self._batch(k), index - self._start(k)
        return {n: values[local] for n, values in columns.items()}

    def _iter_range(self, start: int, stop: int) -> Iterator[Sample]:
        assert self._ends is not None
        self._cached = (-1, {})  # a new run decodes afresh
        k, i = int(np.searchsorted(self._ends, start, side="right")), start
        while i < stop:
            base, end = self._start(k), min(stop, int(self._ends[k]))
            columns = self._batch(k) if end > i else {}
            for j in range(i, end):
                yield {n: values[j - base] for n, values in columns.items()}
            i, k = end, k + 1


FORMAT = ShardFormat(name="arrow", extension=".arrow", reader=ArrowStreamReader,
                     ShardWriter=no_writer("Arrow IPC (Hugging Face save_to_disk)"), writes=False)
