"""Parquet shards (pyarrow): one row per sample, one column per field.

Writer: columns by schema (``bytes`` -> binary, ``str`` -> string, ``int`` -> int64, ``float``
-> float64, ``ndarray`` -> binary holding :func:`readers.codec.encode_field` bytes). The schema
is stored as JSON under the key-value metadata key ``datacache.schema``. A row group is written
every ``row_group_rows`` rows (or ``row_group_bytes`` buffered payload bytes).

Reader: memory-mapped; row groups map to index ranges; ``get(i)`` reads one row group and keeps
the last one decoded as Python columns. ``open(path, columns=[...])`` projects columns. Files
without datacache metadata (any Parquet file, e.g. from Hugging Face) read too: values come out
as pyarrow's ``to_pylist`` gives them, except that a fixed-size list of numbers (arrow's
``fixed_size_list<float32, 4>``, nested ones too) comes out as a writable ``ndarray`` of its
dtype and shape (``(4,)``), so batches stack it as one tensor. :attr:`schema` reports binary ->
``bytes``, string -> ``str``, integer -> ``int``, floating -> ``float``, such a fixed-size list
-> ``ndarray`` and any other type as ``"any"`` (a variable-length list stays a Python list).

Thread safety: one reader or writer per thread.
"""
from __future__ import annotations

import io
import math
import os
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ._bufpool import shared_pool
from .base import ReadRange, ShardFormat
from .base import ShardReader as _BaseReader
from .base import ShardWriter as _BaseWriter
from .codec import Sample, Schema, decode_field, encode_field, schema_from_json, schema_to_json
from .errors import HINT_CORRUPT, HINT_FORMAT, ReaderError

__all__ = ["ParquetShardReader", "ParquetShardWriter", "FORMAT", "SCHEMA_KEY", "arrow_kind", "probe"]

SCHEMA_KEY = b"datacache.schema"
_MAGIC = b"PAR1"
_FOOTER_TAIL = 64 << 10
_ARROW_TYPES: dict[str, pa.DataType] = {
    "bytes": pa.binary(), "str": pa.string(), "int": pa.int64(), "float": pa.float64(),
    "ndarray": pa.binary(),
}


def _to_column(kind: str, value: Any) -> tuple[Any, int]:
    """Column value and payload size for one field."""
    if kind == "ndarray" or kind == "bytes":
        data = encode_field(kind, value)
        return data, len(data)
    if kind == "str":
        return value, len(value.encode("utf-8"))
    return (int(value), 8) if kind == "int" else (float(value), 8)


class ParquetShardWriter(_BaseWriter):
    """Write a Parquet shard; ``compression`` is any Parquet codec pyarrow supports."""

    def __init__(self, path: str | os.PathLike[str], schema: Schema, *,
                 row_group_rows: int = 1024, row_group_bytes: int = 64 << 20,
                 compression: str = "zstd") -> None:
        super().__init__(path, schema)
        if row_group_rows < 1 or row_group_bytes < 1:
            raise ValueError("row_group_rows and row_group_bytes must be >= 1")
        self.row_group_rows, self.row_group_bytes = row_group_rows, row_group_bytes
        self._arrow_schema = pa.schema(
            [(field, _ARROW_TYPES[kind]) for field, kind in self.schema.items()],
            metadata={SCHEMA_KEY: schema_to_json(self.schema).encode("utf-8")})
        self._writer = pq.ParquetWriter(self.tmp_path, self._arrow_schema,
                                        compression=compression)
        self._columns: dict[str, list[Any]] = {field: [] for field in self.schema}
        self._rows = 0
        self._buffered = 0

    def _write(self, sample: Sample) -> int:
        size = 0
        for field, kind in self.schema.items():
            value, n = _to_column(kind, sample[field])
            self._columns[field].append(value)
            size += n
        self._rows += 1
        self._buffered += size
        if self._rows >= self.row_group_rows or self._buffered >= self.row_group_bytes:
            self._flush()
        return size

    def _flush(self) -> None:
        if not self._rows:
            return
        arrays = [pa.array(self._columns[f], type=self._arrow_schema.field(f).type)
                  for f in self.schema]  # may come back chunked above 2 GiB: fine for a table
        table = pa.Table.from_arrays(arrays, schema=self._arrow_schema)
        self._writer.write_table(table, row_group_size=self._rows)
        self._columns = {field: [] for field in self.schema}
        self._rows = self._buffered = 0

    def _finish(self) -> None:
        self._flush()
        self._writer.close()

    def _discard(self) -> None:
        self._writer.close()


def arrow_kind(dtype: pa.DataType) -> str:
    """The datacache field kind of an arrow type (``any`` when there is none)."""
    if pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype) \
            or pa.types.is_fixed_size_binary(dtype):
        return "bytes"
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return "str"
    if pa.types.is_integer(dtype):
        return "int"
    if _fixed_shape(dtype) is not None:
        return "ndarray"
    return "float" if pa.types.is_floating(dtype) else "any"


def _fixed_shape(dtype: pa.DataType) -> tuple[int, ...] | None:
    """The shape of one value of a (nested) fixed-size list of numbers or bools, else None."""
    shape: list[int] = []
    while pa.types.is_fixed_size_list(dtype):
        shape.append(dtype.list_size)
        dtype = dtype.value_type
    numeric = pa.types.is_integer(dtype) or pa.types.is_floating(dtype) or pa.types.is_boolean(dtype)
    return tuple(shape) if shape and numeric else None


def _fixed_lists(chunk: pa.Array, shape: tuple[int, ...]) -> list[np.ndarray | None] | None:
    """The rows of a fixed-size list array as views of one writable ndarray (None for a null
    row); None when a number inside a row is null (the caller keeps ``to_pylist`` then)."""
    rows, leaf = chunk.is_valid(), chunk
    for _ in shape:
        leaf = leaf.flatten()  # skips null rows (at each level)
    if leaf.null_count or len(leaf) != math.prod(shape) * rows.true_count:
        return None  # a null number, or a null list inside a valid row
    flat = np.array(leaf.to_numpy(zero_copy_only=False), copy=True).reshape((-1, *shape))
    if rows.true_count == len(chunk):
        return list(flat)
    it = iter(flat)
    return [next(it) if ok else None for ok in rows.to_pylist()]


def _values(column: pa.ChunkedArray, encoded: bool) -> list[Any]:
    """A column's values as samples hold them: floats keep a narrower dtype as numpy scalars
    (``float32`` stays ``float32``), ``encoded`` (codec-encoded array) columns are views of one
    writable copy of the data, so their arrays are writable, as are fixed-size lists of numbers
    (``_fixed_lists``); else ``to_pylist``."""
    if encoded:
        return [v for chunk in column.chunks for v in _binary_views(chunk)]
    shape = _fixed_shape(column.type)
    if shape is not None:
        rows = [_fixed_lists(chunk, shape) for chunk in column.chunks]
        if all(r is not None for r in rows):
            return [v for r in rows for v in r]  # type: ignore[union-attr]
    if pa.types.is_floating(column.type) and column.type != pa.float64():
        return [v if v is None else column.type.to_pandas_dtype()(v) for v in column.to_pylist()] \
            if column.null_count else list(column.to_numpy())
    return column.to_pylist()


def _binary_views(chunk: pa.Array) -> list[memoryview | None]:
    """The values of a binary array as views of one writable copy of its data buffer (a pooled
    buffer: see ``readers._bufpool``)."""
    _, offsets, data = chunk.buffers()
    wide = pa.types.is_large_binary(chunk.type)
    size = 8 if wide else 4
    offs = np.frombuffer(offsets, "<i8" if wide else "<i4", len(chunk) + 1, chunk.offset * size).tolist()
    base, size = offs[0], offs[-1] - offs[0]
    copy = shared_pool().take(size)  # warm pages, reused once no sample views them
    if size:
        copy[:] = memoryview(data).cast("B")[base:base + size]
    views: list[memoryview | None] = [copy[a - base:b - base] for a, b in zip(offs, offs[1:])]
    if chunk.null_count:
        for i in np.flatnonzero(chunk.is_null().to_numpy(zero_copy_only=False)).tolist():
            views[i] = None
    return views


class _RangeFile(io.RawIOBase):
    """A read-only file served by ``read_range``; the last 64 KiB are read once up front (a
    Parquet footer usually fits, so reading the metadata of a remote file costs one request)."""

    def __init__(self, read_range: ReadRange, size: int) -> None:
        super().__init__()
        self._read_range, self._size, self._pos = read_range, size, 0
        self._tail_start = max(0, size - _FOOTER_TAIL)
        self.tail = read_range(self._tail_start, size)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, {0: 0, 1: self._pos, 2: self._size}[whence] + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        if end <= self._pos:
            return b""
        if self._pos >= self._tail_start:
            data = self.tail[self._pos - self._tail_start:end - self._tail_start]
        else:
            data = self._read_range(self._pos, end)
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def probe(read_range: ReadRange, size: int, name: str) -> tuple[int, Schema]:
    """``(rows, schema)`` of a Parquet file from its footer alone (range reads, usually one);
    :class:`ReaderError` naming ``name`` if it is not a Parquet file."""
    if size < 12:
        raise ReaderError(f"not a parquet file ({size} bytes)", path=name)
    f = _RangeFile(read_range, size)
    if f.tail[-4:] != _MAGIC:
        raise ReaderError("not a parquet file (no PAR1 magic at the end)", path=name)
    try:
        md = pq.read_metadata(f)
        stored = (md.metadata or {}).get(SCHEMA_KEY)
        schema = schema_from_json(stored, name) if stored is not None else \
            {field.name: arrow_kind(field.type) for field in md.schema.to_arrow_schema()}
    except ReaderError:
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ReaderError(f"cannot parse the parquet footer ({exc})", path=name) from None
    return int(md.num_rows), schema


class ParquetShardReader(_BaseReader):
    """Read a Parquet shard through a memory map, one row group at a time.

    ``columns``: read only these top-level columns (samples then hold only them).
    Not thread-safe: one reader per thread.
    """

    _HANDLE_ATTRS = ("_source", "_pf")

    def __init__(self, path: str | os.PathLike[str], *,
                 columns: Sequence[str] | None = None) -> None:
        super().__init__(path)
        self._requested = None if columns is None else list(columns)
        self._source: Any = None
        self._pf: pq.ParquetFile | None = None
        self._ends: np.ndarray | None = None
        self._cached: tuple[int, dict[str, list[Any]]] = (-1, {})
        self._ndarrays: list[str] = []  # columns holding codec-encoded arrays
        self._ensure_open()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_cached"] = (-1, {})  # views of this process's row group copy
        return state

    def _error(self, what: str, exc: BaseException | None = None) -> ReaderError:
        detail = f" ({exc})" if exc is not None else ""
        return ReaderError(f"{what}{detail}", path=self.path, hint=HINT_CORRUPT)

    def _open_handles(self) -> None:
        with open(self.path, "rb") as f:
            head = f.read(4)
        if head != _MAGIC:
            raise ReaderError(f"not a parquet shard (bad magic {head!r} at offset 0, expected "
                              f"{_MAGIC!r})", path=self.path, hint=HINT_FORMAT)
        try:
            self._source = pa.memory_map(self.path, "r")
            self._pf = pq.ParquetFile(self._source)
        except (pa.ArrowException, OSError, ValueError) as exc:  # also a column name not UTF-8
            raise self._error("truncated or corrupt parquet shard", exc) from None
        if self._ends is None:
            self._load_metadata(self._pf)
        elif self._pf.metadata.num_rows != len(self):
            raise self._error("parquet shard changed since it was opened")

    def _close_handles(self) -> None:
        if self._pf is not None:
            self._pf.close()
        if self._source is not None:
            self._source.close()
        self._source = self._pf = None

    def _load_metadata(self, pf: pq.ParquetFile) -> None:
        meta = pf.metadata
        counts = [meta.row_group(k).num_rows for k in range(meta.num_row_groups)]
        if sum(counts) != meta.num_rows:
            raise self._error("row group sizes do not add up to the row count")
        self._ends = np.cumsum(np.asarray(counts, dtype=np.int64))
        arrow = pf.schema_arrow
        stored = (arrow.metadata or {}).get(SCHEMA_KEY)
        kinds = schema_from_json(stored, self.path) if stored is not None else \
            {f.name: arrow_kind(f.type) for f in arrow}
        missing = [name for name in (self._requested or kinds) if name not in arrow.names]
        if missing:
            raise ReaderError(f"parquet shard has no column(s) {missing}", path=self.path,
                              hint=f"Available columns: {arrow.names}")
        names = self._requested if self._requested is not None else list(kinds)
        self.schema = {name: kinds.get(name, "any") for name in names}
        self._ndarrays = [name for name in names
                          if stored is not None and kinds.get(name) == "ndarray"]

    def _decode_ndarray(self, name: str, raw: Any) -> Any:
        if raw is None:
            return None
        try:
            return decode_field("ndarray", raw)
        except ReaderError as exc:
            raise self._error(f"column {name!r}: {exc}") from None

    def __len__(self) -> int:
        assert self._ends is not None
        return int(self._ends[-1]) if len(self._ends) else 0

    def _row_group(self, group: int) -> dict[str, list[Any]]:
        if self._cached[0] == group:
            return self._cached[1]
        assert self._pf is not None and self.schema is not None
        names = list(self.schema)
        try:
            table = self._pf.read_row_group(group, columns=names, use_threads=False)
            columns = {name: _values(table.column(name), name in self._ndarrays) for name in names}
        except (pa.ArrowException, OSError, ValueError) as exc:  # also invalid UTF-8 in a string
            raise self._error(f"row group {group} cannot be read", exc) from None
        self._cached = (group, columns)
        return columns

    def _row(self, columns: dict[str, list[Any]], local: int) -> Sample:
        sample = {name: values[local] for name, values in columns.items()}
        for name in self._ndarrays:
            sample[name] = self._decode_ndarray(name, sample[name])
        return sample

    def _group_start(self, group: int) -> int:
        assert self._ends is not None
        return int(self._ends[group - 1]) if group else 0

    def _get(self, index: int) -> Sample:
        assert self._ends is not None
        group = int(np.searchsorted(self._ends, index, side="right"))
        return self._row(self._row_group(group), index - self._group_start(group))

    def _iter_range(self, start: int, stop: int) -> Iterator[Sample]:
        assert self._ends is not None
        self._cached = (-1, {})  # a new run decodes afresh: no earlier in-place write shows
        group, i = int(np.searchsorted(self._ends, start, side="right")), start
        while i < stop:
            base, end = self._group_start(group), min(stop, int(self._ends[group]))
            columns = self._row_group(group) if end > i else {}
            for j in range(i, end):
                yield self._row(columns, j - base)
            i, group = end, group + 1


FORMAT = ShardFormat(name="parquet", extension=".parquet", reader=ParquetShardReader,
                     ShardWriter=ParquetShardWriter, probe=probe)
