"""Columnar reads: the samples of a run as one table per field, for vectorised batch gathers.

A per-sample read returns a ``dict`` per sample, built in Python: at a million small samples a
second that dict, and every walk over it, is the cost. A :class:`Columns` instead describes the
run's rows field by field with numpy arrays: where each row's value bytes lie in this process's
memory (``addr``, absolute addresses into buffers the table keeps alive: the mapped file for a
raw block, the decompressed buffer of a compressed one), how long they are (``size``), and for an
``ndarray`` field its dtype and each row's shape. A batch is then gathered from these addresses
into its buffer with one vectorised copy per field (``datacache.pytorch.gather``), with no
Python work per sample.

:func:`parse_rows` builds a table from the encoded samples (:func:`readers.codec.encode_sample`)
at given addresses, validating, vectorised, what :func:`readers.codec.decode_sample` validates
(lengths that fit, no trailing bytes, array headers that agree with their data) except the UTF-8
of ``str`` values (checked where the batch is gathered). It returns None where the rows are not
regular enough for one table (an ``ndarray`` field whose rows differ in dtype or number of
dimensions, or anything malformed): the caller then reads those samples one by one, which
raises the precise error where there is one.

Rows of one encoded length whose structure bytes (each field's size, an array's header) are the
first row's have the first row's layout (it is a function of those bytes alone): ``parse_rows``
then parses and validates the first row and compares those few bytes of the others, the common
case of fixed-size samples. The first row's parse is itself skipped where a row of the same schema
and length with the same structure bytes was parsed before in this process (another shard of the
dataset): its layout is the same.

:class:`RowLayouts` keeps what ``parse_rows`` found for each row of a shard (where each field's value
lies from the row's start, its size and shape), so that a reader parses and validates a row once
however many runs read it: a uniformly shuffled epoch reads each shard in many small runs.

:func:`address_view` is the primitive under both: a uint8 array over a span of this process's
address space, to index at absolute addresses. It is only ever indexed at addresses inside
buffers that the caller keeps alive; the span between them is never touched.

Pure functions and immutable tables, thread-safe; a ``RowLayouts`` belongs to one reader, which is
used by one thread at a time.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .codec import Sample, Schema, decode_field

__all__ = ["Column", "Columns", "RowLayouts", "parse_rows", "address_view", "address_of", "is_sorted", "parse_at"]


class _Span:
    """A bare ``__array_interface__`` over addresses ``[lo, lo + n)`` (see ``address_view``)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, lo: int, n: int) -> None:
        self.__array_interface__ = {"data": (lo, False), "shape": (n,), "typestr": "|u1", "version": 3}


def address_view(lo: int, hi: int) -> np.ndarray:
    """A writable uint8 array over this process's addresses ``[lo, hi)``. Index it only at addresses
    inside live buffers (see the module docstring): nothing else in the span is mapped for sure."""
    return np.asarray(_Span(lo, max(1, hi - lo)))


def address_of(buf: Any) -> int:
    """The address of the first byte of ``buf`` (a buffer-protocol object, e.g. a memoryview)."""
    return int(np.frombuffer(buf, np.uint8, 1).ctypes.data) if len(memoryview(buf)) else 0


class Column(NamedTuple):
    """One field of a :class:`Columns` table (``n`` rows)."""

    kind: str  # the schema's kind: int, float, bytes, str, ndarray
    addr: np.ndarray  # int64 (n,): each row's value bytes start here
    size: np.ndarray  # int64 (n,): and are this long
    dtype: str  # numpy dtype.str of every row's value ("<i8", "<f8", "|u1" for bytes and str)
    shape: np.ndarray  # int64 (n, ndim): each row's shape (ndarray; (n, 0) for the others)


_KIND_DTYPE = {"int": "<i8", "float": "<f8", "bytes": "|u1", "str": "|u1"}


class Columns:
    """``n`` rows of one run, field by field (see the module docstring); ``keep``: the buffers
    their addresses point into, alive as long as the table."""

    __slots__ = ("n", "fields", "keep")

    def __init__(self, n: int, fields: dict[str, Column], keep: Sequence[Any]) -> None:
        self.n, self.fields, self.keep = n, fields, list(keep)

    def sample(self, i: int) -> Sample:
        """Row ``i`` as :func:`readers.codec.decode_sample` gives it, in memory of its own."""
        out: Sample = {}
        for name, c in self.fields.items():
            raw = ctypes.string_at(int(c.addr[i]), int(c.size[i])) if c.size[i] else b""
            if c.kind == "ndarray":
                shape = tuple(int(d) for d in c.shape[i])
                out[name] = np.frombuffer(bytearray(raw), np.dtype(c.dtype)).reshape(shape) if raw else \
                    np.empty(shape, np.dtype(c.dtype))
            else:
                out[name] = decode_field(c.kind, raw)
        return out

    def take(self, rows: np.ndarray) -> Columns:
        """Rows ``rows`` of this table (a new table over the same buffers)."""
        return Columns(len(rows), {name: Column(c.kind, c.addr.take(rows), c.size.take(rows), c.dtype,
                                                c.shape.take(rows, axis=0))
                                   for name, c in self.fields.items()}, self.keep)

    @staticmethod
    def concat(columns: Sequence[Column]) -> Column:
        """One field's columns (of one dtype and number of dimensions) one after the other."""
        c = columns[0]
        return Column(c.kind, np.concatenate([x.addr for x in columns]), np.concatenate([x.size for x in columns]),
                      c.dtype, np.concatenate([x.shape for x in columns]))

    @staticmethod
    def join(parts: Sequence[Columns]) -> Columns | None:
        """The rows of ``parts`` one after the other; None if a field's dtype or number of
        dimensions differs between them."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0].fields
        fields = {}
        for name, c in first.items():
            cols = [p.fields[name] for p in parts]
            if any(x.dtype != c.dtype or x.shape.shape[1] != c.shape.shape[1] for x in cols):
                return None
            fields[name] = Columns.concat(cols)
        return Columns(sum(p.n for p in parts), fields, [k for p in parts for k in p.keep])


def is_sorted(a: np.ndarray) -> bool:
    """Whether the 1-d array ``a`` never decreases."""
    return len(a) < 2 or not (a[1:] < a[:-1]).any()


_MAX_DIM = 1 << 40  # a larger declared dimension is left to the per-sample decode (exact integers)


def _u64(span: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The little-endian u64 at each of ``at`` (offsets into ``span``), as int64 (negative where >= 2^63)."""
    if len(span) < 8:
        return np.full(len(at), -1, np.int64)
    words = np.ndarray((len(span) - 7,), dtype="<i8", buffer=span, strides=(1,))  # one at every byte
    return words[at]


def parse_rows(span: np.ndarray, base: int, start: np.ndarray, length: np.ndarray, schema: Schema) -> Columns | None:
    """The table of the encoded samples at offsets ``start`` of ``span`` (``length`` bytes each;
    ``span[0]`` is at address ``base``), or None (see the module docstring). The caller sets the
    table's ``keep``."""
    n = len(start)
    if n > 1 and (length == length[0]).all():
        got = _alike(span, base, start.astype(np.int64), int(length[0]), schema)
        if got is not None:
            return got
    pos = start.astype(np.int64)
    end = pos + length.astype(np.int64)
    fields: dict[str, Column] = {}
    if n == 0:
        z = np.zeros(0, np.int64)
        return Columns(0, {k: Column(v, z, z, _KIND_DTYPE.get(v, "|u1"), np.zeros((0, 0), np.int64))
                           for k, v in schema.items()}, [])
    for name, kind in schema.items():
        if (end - pos < 8).any():
            return None
        size = _u64(span, pos)
        pos = pos + 8
        if (size < 0).any() or (size > end - pos).any():
            return None
        if kind in ("int", "float"):
            if (size != 8).any():
                return None
            fields[name] = Column(kind, base + pos, size, _KIND_DTYPE[kind], np.zeros((n, 0), np.int64))
        elif kind in ("bytes", "str"):
            fields[name] = Column(kind, base + pos, size, "|u1", np.zeros((n, 0), np.int64))
        elif kind == "ndarray":
            col = _ndarray(span, base, pos, size)
            if col is None:
                return None
            fields[name] = col
        else:
            return None
        pos = pos + size
    if (pos != end).any():
        return None
    return Columns(n, fields, [])


def _alike(span: np.ndarray, base: int, start: np.ndarray, length: int, schema: Schema) -> Columns | None:
    """``parse_rows`` of rows of one ``length`` whose structure bytes (each field's size, an array's
    dtype text, number of dimensions and shape) are those of the first row, or None where they are
    not. A row's layout is a function of those bytes alone, so the first row, parsed and validated
    as every row is, stands for all: one comparison of a few bytes per row instead of the parse.
    The first row's own parse is skipped where its structure bytes are those of a row parsed
    before with the same schema and length (``_LAYOUTS``: every shard of a dataset of fixed-size
    samples has one layout)."""
    s0 = int(start[0])
    layout = _known_layout(span, s0, length, schema)
    if layout is None:
        first = parse_rows(span, base, start[:1], np.array([length]), schema)
        if first is None:
            return None
        layout = _Layout.of(first, span, base, s0, length, schema)
    for lo, hi in layout.structure:  # each field's structure bytes, from the row's start
        items = np.ndarray((len(span) - (hi - lo) + 1,), dtype=np.dtype((np.void, hi - lo)), buffer=span,
                           strides=(1,))
        got = items[start + lo].view(np.uint8).reshape(len(start), hi - lo)
        if (got != got[0]).any():
            return None
    n = len(start)
    return Columns(n, {name: Column(kind, base + start + value, np.full(n, size, np.int64), dtype,
                                    np.repeat(shape, n, axis=0))
                       for name, (kind, value, size, dtype, shape) in layout.fields.items()}, [])


class _Layout(NamedTuple):
    """A parsed row's layout, for rows of its schema and length with its structure bytes: per field
    (kind, value start from the row's start, size, dtype, shape (1, ndim)); the structure bytes'
    ranges from the row's start, and their bytes in the parsed row."""

    fields: dict[str, tuple[str, int, int, str, np.ndarray]]
    structure: tuple[tuple[int, int], ...]
    expected: bytes

    @staticmethod
    def of(first: Columns, span: np.ndarray, base: int, s0: int, length: int, schema: Schema) -> _Layout:
        """The layout of ``first`` (row 0 parsed by ``parse_rows``, at ``s0`` in ``span``), kept in
        ``_LAYOUTS``."""
        fields, structure, rel = {}, [], 0
        for name in schema:
            c = first.fields[name]
            value = int(c.addr[0]) - base - s0
            if value > rel:
                structure.append((rel, value))
            fields[name] = (c.kind, value, int(c.size[0]), c.dtype, c.shape[:1].copy())
            rel = value + int(c.size[0])
        layout = _Layout(fields, tuple(structure), _structure_bytes(span, s0, structure))
        known = _LAYOUTS.setdefault((tuple(schema.items()), length), [])
        if len(known) < _LAYOUTS_PER_KEY:
            known.append(layout)
        if len(_LAYOUTS) > _LAYOUTS_MAX:
            _LAYOUTS.clear()
        return layout


# Layouts of rows parsed before, by (schema, row length): read-only once stored (a list only grows,
# to a few per key; the dict is cleared when large). Thread-safe (a reader's table is built in one
# thread; concurrent appends at worst keep one layout twice).
_LAYOUTS: dict[tuple[tuple[tuple[str, str], ...], int], list[_Layout]] = {}
_LAYOUTS_PER_KEY = 8
_LAYOUTS_MAX = 1024


def _structure_bytes(span: np.ndarray, s0: int, structure: Sequence[tuple[int, int]]) -> bytes:
    return b"".join(span[s0 + lo:s0 + hi].tobytes() for lo, hi in structure)


def _known_layout(span: np.ndarray, s0: int, length: int, schema: Schema) -> _Layout | None:
    """A layout parsed before whose structure bytes the row at ``s0`` has, or None."""
    for layout in _LAYOUTS.get((tuple(schema.items()), length), ()):
        if _structure_bytes(span, s0, layout.structure) == layout.expected:
            return layout
    return None


def _ndarray(span: np.ndarray, base: int, pos: np.ndarray, size: np.ndarray) -> Column | None:
    """An ``ndarray`` field's column: every row's header (dtype text, ndim, shape) checked against
    row 0's (validated by the codec), its shape against its data bytes."""
    n = len(pos)
    if (size < 2).any():
        return None
    dlen = span[pos].astype(np.int64)
    d0 = int(dlen[0])
    if (dlen != d0).any() or (size < 2 + d0).any():
        return None
    fixed = span[pos[:, None] + np.arange(1, 2 + d0)]  # dtype text and ndim
    if n > 1 and (fixed[1:] != fixed[0]).any():
        return None
    ndim = int(fixed[0, -1])
    head = 2 + d0 + 8 * ndim
    if (size < head).any():
        return None
    try:  # row 0 through the codec: a valid dtype and shape, or its error later, one by one
        first = decode_field("ndarray", memoryview(span[int(pos[0]):int(pos[0] + size[0])]))
    except Exception:  # noqa: BLE001 - any failure: the per-sample path raises the precise one
        return None
    dtype = first.dtype
    if ndim:
        shape = np.stack([_u64(span, pos + 2 + d0 + 8 * k) for k in range(ndim)], axis=1)
        if (shape < 0).any() or (shape > _MAX_DIM).any():
            return None
        with np.errstate(over="ignore"):
            cells = np.prod(shape.astype(np.float64), axis=1)
        if (cells * dtype.itemsize > size).any():
            return None
        data = np.prod(shape, axis=1) * dtype.itemsize
    else:
        shape = np.zeros((n, 0), np.int64)
        data = np.full(n, dtype.itemsize, np.int64)
    if (data != size - head).any():
        return None
    return Column("ndarray", base + pos + head, data, dtype.str, shape)


class RowLayouts:
    """Each parsed row's layout in one shard (``n`` rows): per field, where its value starts from the
    row's first byte, its size and its shape. A shard's bytes never change under its reader, so a
    row parsed once (and validated by ``parse_rows``) is not parsed again; only its address, which
    depends on where its block lies in memory now, is computed per call. Rows whose layouts
    disagree (an ``ndarray`` field of two dtypes in one shard) switch the cache off: every call then
    parses its rows, as without it. Not thread-safe (its reader's)."""

    __slots__ = ("schema", "parsed", "fields", "off")

    def __init__(self, n: int, schema: Schema) -> None:
        self.schema = schema
        self.parsed: np.ndarray | None = np.zeros(n, bool)  # None: switched off
        self.fields: dict[str, Column] = {}  # per field: kind, dtype; size and shape of every row
        self.off: dict[str, np.ndarray] = {}  # per field: each row's value start, from the row's start

    def table(self, rows: np.ndarray, at: np.ndarray, length: np.ndarray) -> Columns | None:
        """The table of shard rows ``rows``, encoded at absolute addresses ``at`` (``length`` bytes
        each, in buffers the caller keeps alive), as ``parse_rows`` gives it; the caller sets its
        ``keep``."""
        if self.parsed is None or not len(rows):
            return parse_at(at, length, self.schema)
        new = ~self.parsed[rows]
        if new.any():
            got = parse_at(at[new], length[new], self.schema)
            if got is None:
                return None
            if not self._add(rows[new], at[new], got):
                self.parsed = None
                return parse_at(at, length, self.schema)
        return Columns(len(rows), {name: Column(c.kind, at + self.off[name][rows], c.size[rows], c.dtype,
                                                c.shape[rows]) for name, c in self.fields.items()}, [])

    def _add(self, rows: np.ndarray, at: np.ndarray, got: Columns) -> bool:
        """Keep ``got``'s rows' layouts; False where they disagree with the rows kept before."""
        assert self.parsed is not None
        n = len(self.parsed)
        if not self.fields:
            for name, c in got.fields.items():
                self.fields[name] = Column(c.kind, np.zeros(0, np.int64), np.zeros(n, np.int64), c.dtype,
                                           np.zeros((n, c.shape.shape[1]), np.int64))
                self.off[name] = np.zeros(n, np.int64)
        for name, c in got.fields.items():
            mine = self.fields[name]
            if c.dtype != mine.dtype or c.shape.shape[1] != mine.shape.shape[1]:
                return False
        for name, c in got.fields.items():
            mine = self.fields[name]
            self.off[name][rows] = c.addr - at
            mine.size[rows] = c.size
            mine.shape[rows] = c.shape
        self.parsed[rows] = True
        return True


def parse_at(at: np.ndarray, length: np.ndarray, schema: Schema) -> Columns | None:
    """``parse_rows`` of rows at absolute addresses ``at``."""
    first, last = int(at.min()), int((at + length).max())
    return parse_rows(address_view(first, last), first, at - first, length, schema)
