"""Batched mode's default collation: what ``torch.utils.data.default_collate`` makes, with every
column copied once, straight into one batch buffer (a ring slot, see ``datacache.pytorch.batches``).

The structure is torch's own: ``torch.utils.data._utils.collate.collate`` (documented with
``default_collate``) walks mappings, namedtuples and sequences exactly as ``default_collate`` does
and calls a function per leaf type from a ``collate_fn_map``; it is run twice.

1. ``plan``: the leaves are recorded in walk order. A *fixed* column (one type; tensors or arrays
   of one dtype and shape; numbers) gets a place in the buffer (``Field``); so does a *variable*
   one: ``bytes`` or ``str`` values, or arrays (tensors) of one dtype and number of dimensions but
   differing shapes, packed one after the other with a table of where each lies. Any other column
   is collated at once by default_collate's own function, so everything that can fail fails
   before a ring slot is taken.
2. ``assemble``: the columns are copied into the buffer, and the second walk puts what
   ``values`` builds from the buffer (or what the ring hands out for it) where each one was.

What comes out has default_collate's types: tensors of its dtypes and shapes; ``bytes`` and
``str`` as lists of them (built from the buffer, in the receiving process, with one copy; a
``remote`` bytes column's values copied once straight from the worker's memory or file that
holds them, see ``datacache.pytorch.crossread``), or with ``bytes_views`` as one ``PackedBytes`` per field,
zero-copy views of the buffer; tuples become
lists, as there. What default_collate refuses but a batch can carry stays a list of the values:
arrays (tensors) of differing shapes (views of the buffer), arrays of strings or objects, None.

Layout (``Field``): a fixed column is ``nbytes`` at ``offset``; a variable one's values are at
``offset`` (``nbytes`` in all), with its table at ``aux``: for ``bytes``/``str`` the ``n + 1``
int64 offsets of the values (relative to ``offset``; for a ``remote`` column, ``offset`` holds
``n`` rows of ``crossread.WHERE`` int64s instead of the values: each one's address in the
producing process and its file there), for
arrays the ``n`` int64 starts (each 16-byte aligned) then the ``n x ndim`` int64 shapes. Every
part starts 64-byte aligned.

Pure functions of their arguments; thread-safe.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from torch.utils.data import default_collate
from torch.utils.data._utils.collate import collate as _walk
from torch.utils.data._utils.collate import default_collate_fn_map

from .crossread import WHERE, read_values
from .heap import reserve

__all__ = ["Field", "Layout", "BatchPlan", "PackedBytes", "plan", "assemble", "collate", "values", "layout_end",
           "tensors"]

_ALIGN = 64
_ROW_ALIGN = 16  # a variable array's values start at multiples of this


class BatchRing(Protocol):
    """Where ``assemble`` puts a batch's fixed columns (``datacache.pytorch.batches.BatchRing`` implements it)."""

    def acquire(self, nbytes: int) -> int | None: ...

    def buffer(self, slot: int) -> np.ndarray: ...

    def publish(self, slot: int, fields: "Layout") -> list[Any]: ...

    def abandon(self, slot: int) -> None: ...
# default_collate_fn_map's keys of numeric leaves (the rest: str, bytes, and what users register)
_NUMERIC = (torch.Tensor, np.ndarray, (np.bool_, np.number, np.object_), float, int)
_PY_SCALARS = {int: np.dtype(np.int64), float: np.dtype(np.float64), bool: np.dtype(np.bool_)}
_NP_OF_TORCH = {getattr(torch, n): np.dtype(n) for n in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128")}


class Field(NamedTuple):
    """One column of a batch: where it lies in the buffer and what it becomes (a tuple: cheap to
    pickle). ``kind``: "tensor" (fixed: ``shape`` is the batch tensor's), "bytes" or "str"
    (``shape`` is ``(n,)``), "arrays" or "tensors" (``shape`` is ``(n, ndim)``); see the module
    docstring for ``aux``. ``ascii``: every str value is ASCII; ``view``: bytes/str come as one
    ``PackedBytes``; ``remote``: a bytes column whose values stay in the producing process, the
    buffer holding each one's address there (``datacache.pytorch.crossread``)."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    kind: str = "tensor"
    aux: int = 0
    ascii: bool = False
    view: bool = False
    remote: bool = False


def _up(n: int, to: int = _ALIGN) -> int:
    return -(-n // to) * to


def var_field(kind: str, dtype: str, count: int, ndim: int, pos: int, nbytes: int, *, ascii: bool = False,
              view: bool = False) -> tuple[Field, int]:
    """A variable column's ``Field`` placed at ``pos`` (its table first, then its values) and the
    position after it."""
    table = 8 * (count + 1) if kind in ("bytes", "str") else 8 * count * (1 + ndim)
    data = pos + _up(table)
    shape = (count,) if kind in ("bytes", "str") else (count, ndim)
    return Field(dtype, shape, data, nbytes, kind, pos, ascii, view), data + _up(nbytes)


def layout_end(fields: Layout) -> int:
    """The bytes of the buffer ``fields`` use (a variable column's table lies before its values)."""
    return max((f.offset + f.nbytes for f in fields), default=0)


Layout = tuple[Field, ...]


class _Fixed(NamedTuple):
    values: list[Any]
    dtype: np.dtype


class _Var(NamedTuple):
    values: list[Any]
    kind: str  # bytes, str, arrays, tensors
    dtype: np.dtype
    ndim: int


class _Done(NamedTuple):
    value: Any


class BatchPlan(NamedTuple):
    """``plan``'s result: per numeric, bytes or str leaf a ``_Fixed`` or ``_Var`` column or its
    ``_Done`` collation; the columns' layout and the bytes it needs."""

    leaves: list[_Fixed | _Var | _Done]
    fields: Layout
    nbytes: int


def _walk_with(samples: Sequence[Any], leaf: Callable[..., Any]) -> Any:
    fns = dict(default_collate_fn_map)  # copied per batch: sees types a user registered there
    for key in (*_NUMERIC, str, bytes):
        fns[key] = leaf
    fns.setdefault(type(None), _as_list)
    return _walk(list(samples), collate_fn_map=fns)


def _as_list(batch: list[Any], *, collate_fn_map: Any = None) -> list[Any]:
    return list(batch)


def _plain(t: torch.Tensor) -> bool:
    """A tensor whose bytes numpy can view as they are."""
    return t.device.type == "cpu" and t.layout == torch.strided and not (t.requires_grad or t.is_conj() or t.is_neg())


def _fixed(values: list[Any]) -> np.dtype | None:
    """The dtype of a column that goes into the buffer as it is, or None."""
    v0 = values[0]
    kind = type(v0)
    if any(type(v) is not kind for v in values):
        return None
    if kind in _PY_SCALARS:
        return _PY_SCALARS[kind]
    if kind is torch.Tensor:
        dtype = _NP_OF_TORCH.get(v0.dtype)
        same = all(v.dtype == v0.dtype and v.shape == v0.shape and _plain(v) for v in values)
        return dtype if same else None
    if kind is np.ndarray or issubclass(kind, (np.bool_, np.number)):
        dtype = v0.dtype
        same = all(v.dtype == dtype and v.shape == v0.shape for v in values)
        return dtype if same and dtype.kind in "biufc" and dtype.isnative else None
    return None


def _other(values: list[Any]) -> Any:
    """A numeric column that is not fixed: default_collate's result, or the values if it refuses."""
    v0 = values[0]
    if isinstance(v0, (torch.Tensor, np.ndarray)):
        if (isinstance(v0, np.ndarray) and v0.dtype.kind in "SaUO") or any(
                getattr(v, "shape", None) != v0.shape for v in values):
            return list(values)
    return default_collate(values)


def _ragged(values: Sequence[Any], path: tuple[Any, ...]) -> tuple[tuple[Any, ...], int, int] | None:
    """The first field under ``path`` holding lists (or tuples) of differing lengths in ``values``,
    one per sample, with two of those lengths; None if there is none."""
    v0 = values[0]
    if isinstance(v0, Mapping):
        keys: Sequence[Any] = [k for k in v0 if all(isinstance(v, Mapping) and k in v for v in values)]
    elif isinstance(v0, (list, tuple)):
        other = next((len(v) for v in values if not isinstance(v, (list, tuple)) or len(v) != len(v0)), None)
        if other is not None:
            return path, len(v0), other
        keys = range(len(v0))
    else:
        return None
    return next((r for k in keys if (r := _ragged([v[k] for v in values], (*path, k))) is not None), None)


def _ragged_message(path: tuple[Any, ...], a: int, b: int) -> str:
    """One line naming the ragged field (``path`` from ``datacache.plan.epoch.ragged``) and what to do."""
    name = str(path[0]) + "".join(f"[{k!r}]" for k in path[1:]) if path else ""
    what = f"field {name!r}" if path and isinstance(path[0], str) else f"item {name}" if path else "a sample"
    return (f"datacache: {what} holds lists of different lengths in one batch ({a} and {b} items), which the "
            f"default collation cannot stack into one tensor: pass collate_fn= to datacache.DataLoader (a function "
            f"that pads or packs them), or batch_size=None and batch the samples yourself")


def _variable(values: list[Any]) -> _Var | None:
    """The variable column ``values`` make (see the module docstring), or None."""
    kind = type(values[0])
    if any(type(v) is not kind for v in values):
        return None
    if kind is str or kind is bytes:
        return _Var(values, kind.__name__, np.dtype(np.uint8), 0)
    if kind is np.ndarray:
        dtype = values[0].dtype
        if dtype.kind in "biufc" and dtype.isnative and all(v.dtype == dtype and v.ndim == values[0].ndim
                                                            for v in values):
            return _Var(values, "arrays", dtype, values[0].ndim)
    elif kind is torch.Tensor:
        v0 = values[0]
        dtype = _NP_OF_TORCH.get(v0.dtype)
        if dtype is not None and all(v.dtype == v0.dtype and v.dim() == v0.dim() and _plain(v) for v in values):
            return _Var(values, "tensors", dtype, v0.dim())
    return None


def plan(samples: Sequence[Any], *, bytes_views: bool = False) -> BatchPlan:
    """Walk ``samples`` once: the fixed and variable columns and their layout, the other leaves
    collated (``bytes_views``: bytes and str columns come as ``PackedBytes``)."""
    leaves: list[_Fixed | _Var | _Done] = []

    def leaf(values: list[Any], *, collate_fn_map: Any = None) -> None:
        if isinstance(values[0], (str, bytes)):
            var = _variable(values)
            leaves.append(_Done(list(values)) if var is None else var)
            return
        dtype = _fixed(values)
        if dtype is not None:
            leaves.append(_Fixed(values, dtype))
            return
        ragged = isinstance(values[0], (np.ndarray, torch.Tensor)) and any(
            getattr(v, "shape", None) != values[0].shape for v in values)
        var = _variable(values) if ragged else None
        leaves.append(_Done(_other(values)) if var is None else var)

    try:
        _walk_with(samples, leaf)
    except RuntimeError as exc:  # torch's bare "each element in list of batch should be of equal size"
        ragged = _ragged(samples, ())
        if ragged is None:
            raise
        raise RuntimeError(_ragged_message(*ragged)) from exc
    fields, pos = [], 0
    for i, c in enumerate(leaves):
        if isinstance(c, _Fixed):
            full = (len(c.values), *np.shape(c.values[0]))
            f = Field(c.dtype.str, full, pos, math.prod(full) * c.dtype.itemsize)
            fields.append(f)
            pos += _up(f.nbytes)
        elif isinstance(c, _Var):
            if c.kind in ("bytes", "str"):
                data = [v.encode("utf-8") for v in c.values] if c.kind == "str" else c.values
                sizes = [len(v) for v in data]
                ascii = c.kind == "str" and all(len(v) == len(e) for v, e in zip(c.values, data))
                leaves[i] = c = c._replace(values=data)
                nbytes = sum(sizes)
            else:
                ascii = False
                nbytes = sum(_up(_nbytes(v), _ROW_ALIGN) for v in c.values)
            f, pos = var_field(c.kind, c.dtype.str, len(c.values), c.ndim, pos, nbytes, ascii=ascii,
                               view=bytes_views and c.kind in ("bytes", "str"))
            fields.append(f)
    return BatchPlan(leaves, tuple(fields), pos)


def _nbytes(v: Any) -> int:
    return int(v.nbytes) if isinstance(v, np.ndarray) else v.numel() * v.element_size()


def fill(fields: Layout, buf: np.ndarray, columns: list[_Fixed | _Var]) -> None:
    """Copy each column's values into its place in ``buf`` (uint8). Arrays go through ``memoryview``
    slices, a plain ``memcpy`` under the GIL: numpy would release and retake the GIL around every
    sample, and with the pipeline's other threads waiting that is a futex round trip per sample."""
    for f, col in zip(fields, columns):
        if isinstance(col, _Var):
            _fill_var(f, buf, col)
            continue
        out = field_array(buf, f)
        values = col.values
        if isinstance(values[0], torch.Tensor):
            values = [v.numpy() for v in values]
        if out.ndim == 1:  # numbers, numpy scalars, 0-d arrays
            out[:] = values
            continue
        if f.nbytes == 0:
            continue
        dst, step = memoryview(out).cast("B"), f.nbytes // len(values)
        for i, v in enumerate(values):
            if v.flags.c_contiguous:
                dst[i * step:(i + 1) * step] = v.data.cast("B")
            else:
                out[i] = v


def _fill_var(f: Field, buf: np.ndarray, col: _Var) -> None:
    """A variable column: its table, then each value copied to its place."""
    n = len(col.values)
    dst = memoryview(buf)
    if col.kind in ("bytes", "str"):
        sizes = np.fromiter((len(v) for v in col.values), np.int64, n)
        offsets = np.frombuffer(buf, np.int64, n + 1, f.aux)
        offsets[0] = 0
        np.cumsum(sizes, out=offsets[1:])
        at = f.offset
        for v in col.values:
            dst[at:at + len(v)] = v
            at += len(v)
        return
    values = [v.numpy() for v in col.values] if col.kind == "tensors" else col.values
    sizes = np.fromiter((v.nbytes for v in values), np.int64, n)
    starts = np.frombuffer(buf, np.int64, n, f.aux)
    starts[0] = 0
    np.cumsum(-(-sizes[:-1] // _ROW_ALIGN) * _ROW_ALIGN, out=starts[1:])
    shapes = np.frombuffer(buf, np.int64, n * col.ndim, f.aux + 8 * n).reshape(n, col.ndim)
    shapes[:] = [v.shape for v in values] if col.ndim else np.zeros((n, 0), np.int64)
    for v, at in zip(values, (f.offset + starts).tolist()):
        if v.flags.c_contiguous:
            dst[at:at + v.nbytes] = v.data.cast("B") if v.nbytes else b""
        else:
            np.frombuffer(buf, v.dtype, v.size, at).reshape(v.shape)[...] = v


def field_array(buf: Any, f: Field) -> np.ndarray:
    """Fixed column ``f`` of the buffer ``buf``, as an array (writable when ``buf`` is)."""
    dtype = _dtype(f.dtype)
    return np.frombuffer(buf, dtype, f.nbytes // dtype.itemsize, f.offset).reshape(f.shape)


_DTYPES: dict[str, np.dtype] = {}


def _dtype(name: str) -> np.dtype:
    d = _DTYPES.get(name)
    if d is None:
        d = _DTYPES.setdefault(name, np.dtype(name))
    return d


def values(buf: Any, fields: Layout, producer: int = 0) -> list[Any]:
    """What each column of the buffer ``buf`` becomes (see the module docstring): tensors and
    arrays viewing ``buf`` (so keeping it alive), lists of bytes or str copied out of it (or, for
    a ``remote`` column, out of process ``producer``), or ``PackedBytes`` views."""
    return [torch.from_numpy(field_array(buf, f)) if f.kind == "tensor" else _var_value(buf, f, producer)
            for f in fields]


def _var_value(buf: Any, f: Field, producer: int = 0) -> Any:
    n = f.shape[0]
    if f.kind in ("bytes", "str"):
        offsets = np.frombuffer(buf, np.int64, n + 1, f.aux)
        if f.view:
            data = np.frombuffer(buf, np.uint8, f.nbytes, f.offset) if f.nbytes else np.zeros(0, np.uint8)
            return PackedBytes(torch.from_numpy(data), torch.from_numpy(offsets), f.kind)
        reserve(int(offsets[-1]))  # the values' memory stays warm from batch to batch
        if f.remote:
            where = np.frombuffer(buf, np.int64, WHERE * n, f.offset).reshape(n, WHERE)
            return read_values(producer, where, np.diff(offsets))
        with memoryview(buf) as whole:
            return _copied(whole.cast("B")[f.offset:f.offset + f.nbytes], offsets.tolist(), f.kind, f.ascii)
    ndim = f.shape[1]
    starts = np.frombuffer(buf, np.int64, n, f.aux).tolist()
    shapes = np.frombuffer(buf, np.int64, n * ndim, f.aux + 8 * n).reshape(n, ndim).tolist()
    dtype = _dtype(f.dtype)
    out = [np.frombuffer(buf, dtype, math.prod(shape), f.offset + at).reshape(shape)
           for at, shape in zip(starts, shapes)]
    return [torch.from_numpy(a) for a in out] if f.kind == "tensors" else out


def _copied(mv: memoryview, cuts: list[int], kind: str, ascii: bool) -> list[Any]:
    """The values of a bytes or str column (value ``i``: ``mv[cuts[i]:cuts[i + 1]]``) as ``bytes``
    or ``str``, each copied once out of ``mv`` (``ascii``: the column holds ASCII alone)."""
    if kind == "bytes":
        return [mv[a:b].tobytes() for a, b in zip(cuts, cuts[1:])]
    if ascii:
        text = str(mv, "ascii")
        return [text[a:b] for a, b in zip(cuts, cuts[1:])]
    return [str(mv[a:b], "utf-8") for a, b in zip(cuts, cuts[1:])]


class PackedBytes:
    """A batch's ``bytes`` or ``str`` column as one buffer and its offsets (``bytes_views=True``):
    value ``i`` is ``data[offsets[i]:offsets[i + 1]]``, viewing the batch's shared memory (which it
    keeps, as a tensor of the batch does). ``p[i]``: a ``memoryview`` of the bytes, or the decoded
    ``str`` (``kind``); ``p.tensor(i)``: a uint8 tensor view (e.g. for
    ``torchvision.io.decode_jpeg``); ``p.tolist()``: what ``default_collate`` gives, a list of
    ``bytes`` or ``str``. ``pin_memory()`` pins ``data`` and ``offsets``, as torch's pinning
    thread asks. Not a ``Sequence`` subclass, so that torch's ``default_convert`` leaves it whole.
    Thread-safe to read."""

    __slots__ = ("data", "offsets", "kind")

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor, kind: str) -> None:
        self.data, self.offsets, self.kind = data, offsets, kind

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _span(self, i: int) -> tuple[int, int]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} values")
        i %= n
        return int(self.offsets[i]), int(self.offsets[i + 1])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        a, b = self._span(i)
        raw = memoryview(self.data.numpy())[a:b]
        return str(raw, "utf-8") if self.kind == "str" else raw

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def tensor(self, i: int) -> torch.Tensor:
        """Value ``i``'s bytes as a uint8 tensor viewing the batch."""
        a, b = self._span(i)
        return self.data[a:b]

    def tolist(self) -> list[Any]:
        return _copied(memoryview(self.data.numpy()), self.offsets.tolist(), self.kind, ascii=False)

    def pin_memory(self, device: Any = None) -> PackedBytes:
        return PackedBytes(self.data.pin_memory(), self.offsets.pin_memory(), self.kind)

    def __reduce__(self) -> tuple[Any, ...]:
        return PackedBytes, (self.data, self.offsets, self.kind)

    def __repr__(self) -> str:
        return f"PackedBytes({len(self)} {self.kind} values, {self.data.numel()} bytes)"


def assemble(samples: Sequence[Any], batch: BatchPlan, ring: BatchRing | None = None) -> Any:
    """The collated batch of ``samples`` (planned as ``batch``): its columns in ``ring`` when it
    has a free slot of the right size, else in ordinary memory."""
    fields = batch.fields
    slot = ring.acquire(batch.nbytes) if ring is not None and fields else None
    buf = ring.buffer(slot) if slot is not None else np.empty(max(batch.nbytes, 1), np.uint8)  # type: ignore[union-attr]
    try:
        fill(fields, buf, [c for c in batch.leaves if not isinstance(c, _Done)])
    except BaseException:
        if slot is not None:
            assert ring is not None
            ring.abandon(slot)
        raise
    if slot is None:
        made = iter(values(buf, fields))
    else:
        assert ring is not None
        made = iter(ring.publish(slot, fields))
    planned = iter(batch.leaves)

    def leaf(values: list[Any], *, collate_fn_map: Any = None) -> Any:
        c = next(planned)
        return c.value if isinstance(c, _Done) else next(made)

    return _walk_with(samples, leaf)


def collate(samples: Sequence[Any], ring: BatchRing | None = None) -> Any:
    """Collate ``samples`` as ``default_collate`` does (see the module docstring), the columns
    into ``ring`` when given."""
    return assemble(samples, plan(samples), ring)


def tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``batch``, through mappings, lists and tuples (as default_collate nests them)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from tensors(value)
