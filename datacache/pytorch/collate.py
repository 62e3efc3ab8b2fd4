"""Batched mode's default collation: what ``torch.utils.data.default_collate`` makes, with every
fixed-shape column copied once, straight into one batch buffer (a ring slot, see ``datacache.pytorch.batches``).

The structure is torch's own: ``torch.utils.data._utils.collate.collate`` (documented with
``default_collate``) walks mappings, namedtuples and sequences exactly as ``default_collate`` does
and calls a function per leaf type from a ``collate_fn_map``; it is run twice.

1. ``plan``: the numeric leaves (tensors, arrays, numpy scalars, ints, floats, bools) are recorded
   in walk order. A *fixed* column (one type; tensors or arrays of one dtype and shape) gets a
   place in the buffer (``Field``); any other is collated at once by default_collate's own
   function, so everything that can fail fails before a ring slot is taken.
2. ``assemble``: the fixed columns are copied into the buffer, and the second walk puts a tensor
   viewing the buffer (or what the ring hands out for it) where each one was.

Every tensor has the dtype and shape default_collate gives; strings and bytes stay lists, tuples
become lists, as there. What default_collate refuses but a batch can carry stays a list of the
values: tensors or arrays of differing shapes, arrays of strings or objects, None.

Pure functions of their arguments; thread-safe.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from torch.utils.data import default_collate
from torch.utils.data._utils.collate import collate as _walk
from torch.utils.data._utils.collate import default_collate_fn_map

__all__ = ["Field", "Layout", "BatchPlan", "plan", "assemble", "collate"]

_ALIGN = 64


class BatchRing(Protocol):
    """Where ``assemble`` puts a batch's fixed columns (``datacache.pytorch.batches.BatchRing`` implements it)."""

    def acquire(self, nbytes: int) -> int | None: ...

    def view(self, slot: int, f: "Field") -> np.ndarray: ...

    def publish(self, slot: int, fields: "Layout") -> list[Any]: ...

    def abandon(self, slot: int) -> None: ...
# default_collate_fn_map's keys of numeric leaves (the rest: str, bytes, and what users register)
_NUMERIC = (torch.Tensor, np.ndarray, (np.bool_, np.number, np.object_), float, int)
_PY_SCALARS = {int: np.dtype(np.int64), float: np.dtype(np.float64), bool: np.dtype(np.bool_)}
_NP_OF_TORCH = {getattr(torch, n): np.dtype(n) for n in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128")}


class Field(NamedTuple):
    """One fixed-shape column of a batch: where it lies in the buffer (a tuple: cheap to pickle)."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


Layout = tuple[Field, ...]


class _Fixed(NamedTuple):
    values: list[Any]
    dtype: np.dtype


class _Done(NamedTuple):
    value: Any


class BatchPlan(NamedTuple):
    """``plan``'s result: per numeric leaf a ``_Fixed`` column or its ``_Done`` collation; the
    fixed columns' layout and the bytes it needs."""

    leaves: list[_Fixed | _Done]
    fields: Layout
    nbytes: int


def _walk_with(samples: Sequence[Any], leaf: Callable[..., Any]) -> Any:
    fns = dict(default_collate_fn_map)  # copied per batch: sees types a user registered there
    for key in _NUMERIC:
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


def plan(samples: Sequence[Any]) -> BatchPlan:
    """Walk ``samples`` once: the fixed columns and their layout, the other leaves collated."""
    leaves: list[_Fixed | _Done] = []

    def leaf(values: list[Any], *, collate_fn_map: Any = None) -> None:
        dtype = _fixed(values)
        leaves.append(_Done(_other(values)) if dtype is None else _Fixed(values, dtype))

    try:
        _walk_with(samples, leaf)
    except RuntimeError as exc:  # torch's bare "each element in list of batch should be of equal size"
        ragged = _ragged(samples, ())
        if ragged is None:
            raise
        raise RuntimeError(_ragged_message(*ragged)) from exc
    fields, pos = [], 0
    for c in leaves:
        if isinstance(c, _Fixed):
            full = (len(c.values), *np.shape(c.values[0]))
            f = Field(c.dtype.str, full, pos, math.prod(full) * c.dtype.itemsize)
            fields.append(f)
            pos += -(-f.nbytes // _ALIGN) * _ALIGN
    return BatchPlan(leaves, tuple(fields), pos)


def fill(fields: Layout, arrays: list[np.ndarray], columns: list[_Fixed]) -> None:
    """Copy each column's values into its batch array. Arrays go through ``memoryview`` slices, a
    plain ``memcpy`` under the GIL: numpy would release and retake the GIL around every sample,
    and with the pipeline's other threads waiting that is a futex round trip per sample."""
    for f, out, col in zip(fields, arrays, columns):
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


def assemble(samples: Sequence[Any], batch: BatchPlan, ring: BatchRing | None = None) -> Any:
    """The collated batch of ``samples`` (planned as ``batch``): its fixed columns in ``ring`` when
    it has a free slot of the right size, else in ordinary memory."""
    fields = batch.fields
    slot = ring.acquire(batch.nbytes) if ring is not None and fields else None
    if slot is None:
        arrays = [np.empty(f.shape, np.dtype(f.dtype)) for f in fields]
    else:
        assert ring is not None
        arrays = [ring.view(slot, f) for f in fields]
    try:
        fill(fields, arrays, [c for c in batch.leaves if isinstance(c, _Fixed)])
    except BaseException:
        if slot is not None:
            assert ring is not None
            ring.abandon(slot)
        raise
    if slot is None:
        made = iter([torch.from_numpy(a) for a in arrays])
    else:
        assert ring is not None
        made = iter(ring.publish(slot, fields))
    planned = iter(batch.leaves)

    def leaf(values: list[Any], *, collate_fn_map: Any = None) -> Any:
        c = next(planned)
        return next(made) if isinstance(c, _Fixed) else c.value

    return _walk_with(samples, leaf)


def collate(samples: Sequence[Any], ring: BatchRing | None = None) -> Any:
    """Collate ``samples`` as ``default_collate`` does (see the module docstring), the fixed columns
    into ``ring`` when given."""
    return assemble(samples, plan(samples), ring)
