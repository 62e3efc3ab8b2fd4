"""Batches gathered from a columnar consumer's tables: one vectorised copy per field and batch.

A columnar consumer (``datacache.read.consumer``, ``columnar=True``) reads each run as a table
per field (``readers.columns``: where each row's value bytes lie in this process's memory, the
mapped shard file or a decompressed block) and walks its plan in steps (``Consumer.steps``). A
batch is a slice of those positions; ``Gatherer`` writes it into a slot of the batch ring
(``datacache.pytorch.batches``) with:

- per fixed-size field (numbers, arrays of one shape in the batch), one numpy gather of
  ``row``-byte items over a strided view of the address span holding the batch's rows: a C loop
  of copies, one per row, whatever shard or block each row is in (the uniform shuffle's batch
  takes its rows from as many blocks as it has rows, so grouping rows by block would cost a call
  per row); rows of 4 KiB and more are copied by one ``memmove`` each instead;
- per variable field (bytes, str, arrays of differing shapes), its offsets table computed with
  numpy and one ``memmove`` per row, without the GIL's release; a ``bytes`` field whose values
  average ``crossread.MIN_MEAN_BYTES`` or more, in a shared ring where the system allows it and
  with every row in a mapped file (raw blocks: keeping them costs no memory), gets its values'
  addresses instead of their bytes, and the batch's tables are kept alive with its slot
  (``datacache.pytorch.crossread``: the training process copies the values itself);

so no Python object is made per sample, and the layout and the values handed out are those of
the per-sample collation (``datacache.pytorch.collate``): what ``default_collate`` gives. A step
whose tables are not all regular (a format without columnar reads, an unusual dtype) is collated
sample by sample instead, through the same ring.

The str values of a batch are checked to be UTF-8 here, where the readers check them (an ASCII
batch with one vectorised test).

Used by the one batcher thread of a consumer.
"""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ReaderError
from ..read.batcher import batches as run_batches
from ..readers._cowmap import origin
from ..readers.columns import Columns, address_view
from .collate import _ROW_ALIGN, Field, _up, values, var_field
from .crossread import MIN_MEAN_BYTES, WHERE

if TYPE_CHECKING:
    from ..read.consumer import Consumer, Step
    from .batches import RingCollator
    from .rounds import WorkerBatches

__all__ = ["Gatherer", "gathered", "copy_rows"]

_memmove = ctypes.PyDLL(None).memmove  # PyDLL: the GIL is kept across the call (one per row)
_memmove.restype = ctypes.c_void_p
_memmove.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_GOOD_KINDS = "biufc"


_ROW_BY_ROW = 4096  # rows at least this long are copied one memmove each (no gather buffer)


def copy_rows(addr: np.ndarray, row: int, out: np.ndarray, span: tuple[int, int] | None = None) -> None:
    """``out`` (``len(addr) * row`` bytes, contiguous) <- the ``row`` bytes at each address in
    ``addr`` (each inside a buffer the caller keeps alive). Short rows: one numpy gather of
    ``row``-byte items over the span of the addresses (a C loop; the GIL stays held below 500 rows),
    then one ``memmove`` into ``out``; long rows: one ``memmove`` each, straight into ``out``
    (a gather buffer of a batch of them would be a second pass over the batch in memory, not cache).
    ``span``: addresses ``[lo, hi)`` holding every row, where the caller knows them."""
    n = len(addr)
    if row == 0 or n == 0:
        return
    dst = int(out.ctypes.data)
    if row >= _ROW_BY_ROW:
        _copy_each(addr, np.full(n, row, np.int64), dst + row * np.arange(n, dtype=np.int64))
        return
    lo, hi = span if span is not None else (int(addr.min()), int(addr.max()) + row)
    items = np.ndarray((hi - lo - row + 1,), dtype=np.dtype((np.void, row)), buffer=address_view(lo, hi),
                       strides=(1,))
    got = items[addr - lo]
    _memmove(dst, int(got.ctypes.data), n * row)


def _file_backed(buf: Any) -> bool:
    """Whether ``buf`` (an array or memoryview, through its bases) views a file mapping: memory that
    costs nothing more kept a while (a decompressed block's buffer would be one more per batch)."""
    return _mapping(buf) is not None


def _mapping(buf: Any) -> mmap.mmap | None:
    """The file mapping ``buf`` (an array or memoryview) views through its bases, if any."""
    for _ in range(8):
        if isinstance(buf, mmap.mmap):
            return buf
        buf = getattr(buf, "base", None) if isinstance(buf, np.ndarray) else getattr(buf, "obj", None)
        if buf is None:
            return None
    return None


def _copy_each(addr: np.ndarray, size: np.ndarray, dst: np.ndarray) -> None:
    """``size[i]`` bytes from ``addr[i]`` to ``dst[i]``, for each i (one ``memmove`` each)."""
    for s, d, n in zip(addr.tolist(), dst.tolist(), size.tolist()):
        if n:
            _memmove(d, s, n)


class _StepTable:
    """A step's tables concatenated per field (``regular``: all of them ``Columns`` that agree on
    each field's dtype and number of dimensions); ``index``: per position, its row there."""

    def __init__(self, step: Step) -> None:
        self.step = step
        tables = step.tables
        self.regular = all(isinstance(t, Columns) for t in tables)
        self._origins: dict[str, np.ndarray] = {}
        if not self.regular:
            return
        first = tables[0].fields
        self.kinds = {name: c.kind for name, c in first.items()}
        self.dtypes = {name: c.dtype for name, c in first.items()}
        if any(t.fields.keys() != first.keys() or any(
                c.dtype != first[name].dtype or c.shape.shape[1] != first[name].shape.shape[1]
                for name, c in t.fields.items()) for t in tables[1:]):
            self.regular = False
            return
        if len(tables) == 1:
            index, columns = step.row, first
        else:
            index = np.cumsum([0] + [t.n for t in tables[:-1]])[step.slot] + step.row
            columns = {name: Columns.concat([t.fields[name] for t in tables]) for name in first}
        # in position order, once per step: a batch's columns are then slices
        self.columns = {name: (c.addr[index], c.size[index], c.shape[index]) for name, c in columns.items()}
        # where every field has one size in the whole step (the common case), a batch needs no
        # check: ``fixed`` is each field's (dtype, row shape) and ``spans`` its rows' address span
        self.fixed: tuple[tuple[str, tuple[int, ...]], ...] | None = None
        fixed = []
        for name, (addr, _, shape) in self.columns.items():
            kind, dtype = self.kinds[name], np.dtype(self.dtypes[name])
            if not len(addr) or kind in ("bytes", "str") or (kind == "ndarray" and not (
                    dtype.kind in _GOOD_KINDS and dtype.isnative and (shape == shape[0]).all())):
                return
            fixed.append((dtype.str, tuple(shape[0].tolist())))
        self.fixed = tuple(fixed)
        self.spans = [(int(a.min()), int(a.max()) + int(sz[0])) for a, sz, _ in self.columns.values()]

    def __len__(self) -> int:
        return len(self.step.pos)

    @functools.cached_property
    def mapped(self) -> bool:
        """Every row in a mapped file: a batch's values may stay there for the consumer (crossread).
        Asked only for a batch with a large bytes column, once per step."""
        return all(t.keep and all(_file_backed(k) for k in t.keep) for t in self.step.tables)

    def origins(self, name: str) -> np.ndarray:
        """Per position, field ``name``'s value's file: (descriptor, st_dev, st_ino, offset), -1s
        where not known (``readers._cowmap.origin``); computed once per step and field."""
        known = self._origins.get(name)
        if known is not None:
            return known
        addr = self.columns[name][0]
        out = self._origins[name] = np.full((len(addr), WHERE - 1), -1, np.int64)
        maps = {id(m): origin(m) for t in self.step.tables for m in map(_mapping, t.keep) if m is not None}
        spans = sorted(o for o in maps.values() if o is not None)
        if not spans or not len(addr):
            return out
        starts = np.array([o.address for o in spans], np.int64)
        at = np.searchsorted(starts, addr, "right") - 1
        inside = at >= 0
        found = np.array([(o.length, o.fd, o.dev, o.ino, o.offset) for o in spans], np.int64)[np.maximum(at, 0)]
        inside &= addr - starts[np.maximum(at, 0)] + self.columns[name][1] <= found[:, 0]
        out[inside, :3] = found[inside, 1:4]
        out[inside, 3] = found[inside, 4] + addr[inside] - starts[at[inside]]
        return out

    def column(self, name: str, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(addresses, sizes, shapes) of field ``name`` for this step's positions ``a .. b - 1``."""
        addr, size, shape = self.columns[name]
        return addr[a:b], size[a:b], shape[a:b]

    def sample(self, j: int) -> Any:
        """Position ``j``'s sample (a dict, as the per-sample read gives it)."""
        t = self.step.tables[int(self.step.slot[j])]
        k = int(self.step.row[j])
        return t.sample(k) if isinstance(t, Columns) else t[k]


Piece = tuple[_StepTable, int, int]


class Gatherer:
    """Batches of a columnar consumer's positions, collated into ``collator``'s ring (see the
    module docstring). Call it with the batch's pieces: (step table, first, end) slices of steps."""

    def __init__(self, collator: RingCollator) -> None:
        self.collator = collator
        self._layouts: dict[Any, tuple[Field, ...]] = {}  # fixed batches' layouts by (rows, fields)

    def __call__(self, pieces: list[Piece]) -> Any:
        tables = [t for t, _, _ in pieces]
        t0 = tables[0]
        if not all(t.regular and t.dtypes == t0.dtypes and t.kinds == t0.kinds for t in tables):
            return self._per_sample(pieces)
        if t0.fixed is not None and all(t.fixed == t0.fixed for t in tables):
            return self._fixed(pieces)
        n = sum(b - a for _, a, b in pieces)
        plan: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] = []
        for name in t0.kinds:
            parts = [t.column(name, a, b) for t, a, b in pieces]
            if len(parts) == 1:
                addr, size, shape = parts[0]
            else:
                if any(p[2].shape[1] != parts[0][2].shape[1] for p in parts):
                    return self._per_sample(pieces)
                addr, size, shape = (np.concatenate([p[k] for p in parts]) for k in range(3))
            plan.append((name, addr, size, shape))
        laid = self._layout(t0, plan, n, lambda: self.collator.cross_read and all(t.mapped for t in tables))
        if laid is None:
            return self._per_sample(pieces)  # collated as default_collate would, value by value
        fields, pos = laid
        variable = any(f.kind != "tensor" for f in fields)
        ring = self.collator.ring_for(pos, variable)
        slot = ring.acquire(pos) if ring is not None and fields else None
        if slot is None and any(f.remote for f in fields):  # no slot: the values go in the batch itself
            fields, pos = self._layout(t0, plan, n, lambda: False)  # type: ignore[misc]
        buf = ring.buffer(slot) if slot is not None else np.empty(max(pos, 1), np.uint8)  # type: ignore[union-attr]
        try:
            fields = [self._fill(buf, f, addr, size, shape, name) for f, (name, addr, size, shape) in zip(fields, plan)]
            for f, (name, *_) in zip(fields, plan):
                if f.remote:  # where each value lies: its address, and its file (crossread.WHERE)
                    where = np.frombuffer(buf, np.int64, WHERE * f.shape[0], f.offset).reshape(-1, WHERE)
                    where[:, 1:] = np.concatenate([t.origins(name)[a:b] for t, a, b in pieces])
        except BaseException:
            if slot is not None:
                ring.abandon(slot)  # type: ignore[union-attr]
            raise
        if slot is None:
            return dict(zip(t0.kinds, values(buf, tuple(fields))))
        if any(f.remote for f in fields):
            ring.hold(slot, pieces)  # type: ignore[union-attr]  # the tables keep the values' memory alive
        return dict(zip(t0.kinds, ring.publish(slot, tuple(fields))))  # type: ignore[union-attr]

    def _layout(self, t0: _StepTable, plan: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]], n: int,
                cross: Callable[[], bool]) -> tuple[list[Field], int] | None:
        """The batch's fields and its size (None: a dtype to collate value by value). ``cross()``
        (asked only for a large bytes column): such columns stay where they are (``remote``: their
        addresses in the batch)."""
        fields: list[Field] = []
        pos = 0
        views = self.collator.bytes_views
        for name, _, size, shape in plan:
            kind, dtype = t0.kinds[name], np.dtype(t0.dtypes[name])
            if kind == "ndarray" and not (dtype.kind in _GOOD_KINDS and dtype.isnative):
                return None
            if kind in ("int", "float") or (kind == "ndarray" and (shape == shape[0]).all()):
                row = int(size[0])
                full = (n, *shape[0].tolist())
                fields.append(Field(dtype.str, full, pos, n * row))
                pos += _up(n * row)
            elif kind in ("bytes", "str"):
                total = int(size.sum())
                if kind == "bytes" and not views and total >= MIN_MEAN_BYTES * n and cross():
                    f, pos = var_field(kind, "|u1", n, 0, pos, 8 * WHERE * n)
                    fields.append(f._replace(remote=True))
                else:
                    f, pos = var_field(kind, "|u1", n, 0, pos, total, view=views)
                    fields.append(f)
            else:  # arrays of differing shapes
                padded = -(-size // _ROW_ALIGN) * _ROW_ALIGN
                f, pos = var_field("arrays", dtype.str, n, shape.shape[1], pos, int(padded.sum()))
                fields.append(f)
        return fields, pos

    def _fixed(self, pieces: list[Piece]) -> Any:
        """A batch whose fields all have one size in its steps: its layout known by its row count,
        each field one ``copy_rows`` over the steps' address span."""
        t0 = pieces[0][0]
        n = sum(b - a for _, a, b in pieces)
        fields = self._layouts.get((n, t0.fixed))
        if fields is None:
            out, pos = [], 0
            for dtype, shape in t0.fixed:  # type: ignore[union-attr]
                nbytes = n * math.prod(shape) * np.dtype(dtype).itemsize
                out.append(Field(dtype, (n, *shape), pos, nbytes))
                pos += _up(nbytes)
            fields = self._layouts[(n, t0.fixed)] = tuple(out)
        total = fields[-1].offset + fields[-1].nbytes
        ring = self.collator.ring_for(total)
        slot = ring.acquire(total) if ring is not None else None
        buf = ring.buffer(slot) if slot is not None else np.empty(max(total, 1), np.uint8)  # type: ignore[union-attr]
        try:
            for k, (f, name) in enumerate(zip(fields, t0.kinds)):
                if len(pieces) == 1:
                    t, a, b = pieces[0]
                    addr, span = t.columns[name][0][a:b], t.spans[k]
                else:
                    addr = np.concatenate([t.columns[name][0][a:b] for t, a, b in pieces])
                    span = (min(t.spans[k][0] for t, _, _ in pieces), max(t.spans[k][1] for t, _, _ in pieces))
                copy_rows(addr, f.nbytes // n if n else 0, buf[f.offset:f.offset + f.nbytes], span)
        except BaseException:
            if slot is not None:
                ring.abandon(slot)  # type: ignore[union-attr]
            raise
        made = ring.publish(slot, fields) if slot is not None else values(buf, fields)  # type: ignore[union-attr]
        return dict(zip(t0.kinds, made))

    def _fill(self, buf: np.ndarray, f: Field, addr: np.ndarray, size: np.ndarray, shape: np.ndarray,
              name: str) -> Field:
        """Copy one field's rows into ``buf`` (and write its table): its ``Field``, final."""
        if f.kind == "tensor":
            copy_rows(addr, f.nbytes // max(len(addr), 1), buf[f.offset:f.offset + f.nbytes])
            return f
        n = len(addr)
        base = int(buf.ctypes.data) + f.offset
        if f.kind in ("bytes", "str"):
            offsets = np.frombuffer(buf, np.int64, n + 1, f.aux)
            offsets[0] = 0
            np.cumsum(size, out=offsets[1:])
            if f.remote:  # each value's address here, read from this process by the consumer
                np.frombuffer(buf, np.int64, WHERE * n, f.offset).reshape(n, WHERE)[:, 0] = addr
                return f
            _copy_each(addr, size, base + offsets[:-1])
            if f.kind == "str":
                data = buf[f.offset:f.offset + f.nbytes]
                ascii = not (data >= 0x80).any()
                if not ascii:
                    _check_utf8(data, offsets, name)
                return f._replace(ascii=ascii)
            return f
        starts = np.frombuffer(buf, np.int64, n, f.aux)
        starts[0] = 0
        np.cumsum(-(-size[:-1] // _ROW_ALIGN) * _ROW_ALIGN, out=starts[1:])
        np.frombuffer(buf, np.int64, n * shape.shape[1], f.aux + 8 * n).reshape(shape.shape)[...] = shape
        _copy_each(addr, size, base + starts)
        return f

    def _per_sample(self, pieces: list[Piece]) -> Any:
        return self.collator([t.sample(j) for t, a, b in pieces for j in range(a, b)])


def _check_utf8(data: np.ndarray, offsets: np.ndarray, name: str) -> None:
    """Raise ``ReaderError`` (as the readers do) where a str value of the batch is not UTF-8.
    Values that are each valid UTF-8 make a valid whole whose cuts all fall on a character's
    first byte; that is checked at once, and each value decoded only to name the first bad one."""
    cuts = offsets.tolist()
    starts = offsets[:-1][offsets[:-1] < offsets[1:]]  # the first byte of every non-empty value
    try:
        str(memoryview(data), "utf-8")
        if not ((data[starts] & 0xC0) == 0x80).any():
            return
    except UnicodeDecodeError:
        pass
    with memoryview(data) as raw:
        for a, b in zip(cuts, cuts[1:]):
            try:
                str(raw[a:b], "utf-8")
            except UnicodeDecodeError as exc:
                raise ReaderError(f"field {name!r}: str field is not valid UTF-8 ({exc.reason})") from None


def gathered(consumer: Consumer, batches: WorkerBatches, gather: Callable[[list[Piece]], Any],
             mark: Callable[[int], None]) -> Iterator[Any]:
    """``batched`` for a columnar consumer: yield its positions in ``batches``' sizes, each batch
    ``gather``ed; ``mark(position)`` before each batch is yielded (and once with the start)."""
    steps = consumer.steps()
    current: list[Any] = [None, 0]  # the step table being cut into batches, and where

    def take(n: int) -> list[Piece]:
        pieces: list[Piece] = []
        while n > 0:
            table, at = current
            if table is None or at == len(table):
                step = next(steps, None)
                if step is None:
                    break
                table, at = _StepTable(step), 0
            k = min(n, len(table) - at)
            pieces.append((table, at, at + k))
            current[:] = [table, at + k]
            n -= k
        return pieces

    def make_batch(j: int) -> tuple[Any, int] | None:
        pieces = take(batches.size)
        if not pieces:
            return None
        batch = gather(pieces)
        table, _, end = pieces[-1]
        consumer.consumed = int(table.step.pos[end - 1]) + 1
        return batch, consumer.consumed

    def finish() -> None:
        current[:] = [None, 0]
        steps.close()

    return run_batches(consumer, batches.count, make_batch, mark, finish=finish)
