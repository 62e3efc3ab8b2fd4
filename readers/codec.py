"""Sample schemas and the compact binary sample encoding shared by the shard formats.

A sample is a ``dict`` field -> ``bytes | str | int | float | numpy.ndarray``. A schema is a
``dict`` field -> kind, kind in :data:`KINDS`. Encodings (all little-endian):

* ``bytes``: the bytes; ``str``: UTF-8; ``int``: int64; ``float``: float64;
* ``ndarray``: ``u8 len(dtype.str)``, ``dtype.str`` (ASCII), ``u8 ndim``, ``ndim x u64`` shape,
  then the raw C-contiguous data. Object, structured and zero-itemsize dtypes are refused.
* a whole sample (:func:`encode_sample`): per schema field, in schema order, ``u64 length`` then
  the field encoding.

Decoding is bounds-checked: a declared length or shape that does not fit the buffer raises
:class:`ReaderError` and never allocates. ``ndarray`` fields decode zero-copy with
:func:`numpy.frombuffer`: the arrays are views of the buffer, writable when it is (the readers
decode from writable memory, so samples can be changed in place). All functions are pure and
thread-safe.
"""
from __future__ import annotations

import copy
import json
import math
import struct
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import ReaderError

__all__ = [
    "Sample", "Schema", "KINDS", "check_schema", "infer_schema", "check_sample", "encode_field", "decode_field",
    "encode_sample", "decode_sample", "decode_uniform", "owned", "schema_to_json", "schema_from_json",
]

Sample = dict[str, Any]
Schema = dict[str, str]
KINDS = ("bytes", "str", "int", "float", "ndarray")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_MAX_NDIM = 64
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def check_schema(schema: Mapping[str, str]) -> Schema:
    """Validate ``schema`` and return it as a plain dict (raises :class:`ValueError`)."""
    if not isinstance(schema, Mapping) or not schema:
        raise ValueError(f"a schema is a non-empty dict field -> kind, got {schema!r}")
    for field, kind in schema.items():
        if not isinstance(field, str) or not field or "\x00" in field:
            raise ValueError(f"schema field names must be non-empty str without NUL: {field!r}")
        if kind not in KINDS:
            raise ValueError(f"schema field {field!r}: unknown kind {kind!r}; use one of {KINDS}")
    return dict(schema)


def _kind_of(field: str, value: Any) -> str:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"field {field!r}: bool is not supported; store it as int (0/1)")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (int, np.integer)):
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    if isinstance(value, np.ndarray):
        _check_dtype(field, value.dtype)
        return "ndarray"
    raise TypeError(f"field {field!r}: unsupported type {type(value).__name__}; "
                    f"use bytes, str, int, float or numpy.ndarray")


def infer_schema(sample: Mapping[str, Any]) -> Schema:
    """Derive a schema from one sample (raises :class:`TypeError` naming a bad field)."""
    if not isinstance(sample, Mapping):
        raise TypeError(f"a sample is a dict field -> value, got {type(sample).__name__}")
    return check_schema({field: _kind_of(field, value) for field, value in sample.items()})


def _dtype_problem(dtype: np.dtype) -> str | None:
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        return (f"numpy dtype {dtype} is not supported "
                f"(object, structured and sub-array dtypes are refused)")
    if dtype.itemsize == 0:
        return f"numpy dtype {dtype} has zero itemsize"
    return None


def _check_dtype(field: str, dtype: np.dtype) -> None:
    problem = _dtype_problem(dtype)
    if problem:
        raise TypeError(f"field {field!r}: {problem}")


_ACCEPTS: dict[str, tuple[type, ...]] = {
    "bytes": (bytes, bytearray, memoryview),
    "str": (str,),
    "int": (int, np.integer),
    "float": (float, int, np.floating, np.integer),
    "ndarray": (np.ndarray,),
}


def check_sample(sample: Mapping[str, Any], schema: Schema) -> None:
    """Check that ``sample`` has exactly the schema's fields with compatible values."""
    if not isinstance(sample, Mapping):
        raise TypeError(f"a sample is a dict field -> value, got {type(sample).__name__}")
    if sample.keys() != schema.keys():
        missing = sorted(schema.keys() - sample.keys())
        extra = sorted(sample.keys() - schema.keys())
        raise ValueError(f"sample fields do not match the schema: missing {missing}, "
                         f"unexpected {extra}")
    for field, kind in schema.items():
        value = sample[field]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, _ACCEPTS[kind]):
            raise TypeError(f"field {field!r}: expected {kind}, got {type(value).__name__}")
        if kind == "int" and not _INT64_MIN <= int(value) <= _INT64_MAX:
            raise ValueError(f"field {field!r}: int {value} does not fit in int64")
        if kind == "ndarray":
            _check_dtype(field, value.dtype)
            if value.ndim > _MAX_NDIM:
                raise ValueError(f"field {field!r}: ndim {value.ndim} > {_MAX_NDIM}")


def _encode_ndarray(value: np.ndarray) -> bytes:
    dtype = value.dtype.str.encode("ascii")
    shape = b"".join(_U64.pack(d) for d in value.shape)
    data = np.ascontiguousarray(value).tobytes()
    return b"".join((bytes((len(dtype),)), dtype, bytes((value.ndim,)), shape, data))


def encode_field(kind: str, value: Any) -> bytes:
    """Encode one field value of ``kind`` (see the module docstring for the layout)."""
    if kind == "bytes":
        return bytes(value)
    if kind == "str":
        return value.encode("utf-8")
    if kind == "int":
        return _I64.pack(int(value))
    if kind == "float":
        return _F64.pack(float(value))
    if kind == "ndarray":
        return _encode_ndarray(value)
    raise ValueError(f"unknown field kind {kind!r}; use one of {KINDS}")


def _fixed(kind: str, raw: memoryview, st: struct.Struct) -> Any:
    if len(raw) != st.size:
        raise ReaderError(f"{kind} field has {len(raw)} bytes, expected {st.size}")
    return st.unpack(raw)[0]


# Validated ndarray headers (dtype text, ndim, shape) -> (dtype, shape, data bytes): the samples
# of a dataset share a handful of headers, so each is parsed and checked once. Bounded.
_HEADERS: dict[bytes, tuple[np.dtype, tuple[int, ...], int]] = {}
_MAX_HEADERS = 4096


def _decode_ndarray(raw: memoryview) -> np.ndarray:
    n = len(raw)
    if n < 1 or n < 1 + raw[0] + 1:
        raise ReaderError("ndarray field header is truncated")
    end = 2 + raw[0] + 8 * raw[1 + raw[0]]
    known = _HEADERS.get(bytes(raw[:end])) if end <= n else None
    if known is not None and known[2] == n - end and n > end:
        return np.frombuffer(raw, known[0], offset=end).reshape(known[1])
    arr = _parse_ndarray(raw)
    if end <= n:
        if len(_HEADERS) >= _MAX_HEADERS:
            _HEADERS.clear()
        _HEADERS[bytes(raw[:end])] = (arr.dtype, arr.shape, n - end)
    return arr


def _parse_ndarray(raw: memoryview) -> np.ndarray:
    n = len(raw)
    dlen = raw[0]
    try:
        dtype = np.dtype(bytes(raw[1:1 + dlen]).decode("ascii"))
    except Exception as exc:  # untrusted text: numpy raises many types
        raise ReaderError(f"ndarray field has an invalid dtype ({exc})") from None
    problem = _dtype_problem(dtype)
    if problem:
        raise ReaderError(f"ndarray field: {problem}")
    ndim = raw[1 + dlen]
    pos = 2 + dlen
    if ndim > _MAX_NDIM or pos + 8 * ndim > n:
        raise ReaderError(f"ndarray field declares {ndim} dimensions that do not fit the buffer")
    shape = tuple(_U64.unpack_from(raw, pos + 8 * k)[0] for k in range(ndim))
    pos += 8 * ndim
    if any(d >= 2**62 for d in shape) or math.prod(shape) * dtype.itemsize != n - pos:
        raise ReaderError(f"ndarray field declares shape {shape} of {dtype}, which does not "
                          f"match its {n - pos} data bytes")
    try:
        if n == pos:  # empty array: the shape has a 0 dimension
            return np.empty(shape, dtype)
        return np.frombuffer(raw, dtype, offset=pos).reshape(shape)
    except ValueError as exc:
        raise ReaderError(f"ndarray field declares an impossible shape {shape} ({exc})") from None


def _byte_view(buf: bytes | memoryview) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def decode_field(kind: str, raw: bytes | memoryview) -> Any:
    """Decode one field; raises :class:`ReaderError` (without a path) for malformed input."""
    raw = _byte_view(raw)
    if kind == "bytes":
        return bytes(raw)
    if kind == "str":
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise ReaderError(f"str field is not valid UTF-8 ({exc.reason})") from None
    if kind == "int":
        return _fixed("int", raw, _I64)
    if kind == "float":
        return _fixed("float", raw, _F64)
    if kind == "ndarray":
        return _decode_ndarray(raw)
    raise ReaderError(f"unknown field kind {kind!r}")


def encode_sample(sample: Mapping[str, Any], schema: Schema) -> bytes:
    """Encode a (checked) sample: per schema field ``u64 length`` + field encoding."""
    parts: list[bytes] = []
    for field, kind in schema.items():
        data = encode_field(kind, sample[field])
        parts.append(_U64.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def decode_sample(buf: bytes | memoryview, schema: Schema) -> Sample:
    """Decode :func:`encode_sample` output; :class:`ReaderError` if malformed or truncated."""
    view = _byte_view(buf)
    n, pos = len(view), 0
    sample: Sample = {}
    for field, kind in schema.items():
        if pos + 8 > n:
            raise ReaderError(f"sample is truncated before field {field!r}")
        size = _U64.unpack_from(view, pos)[0]
        pos += 8
        if size > n - pos:
            raise ReaderError(f"field {field!r} declares {size} bytes but only "
                              f"{n - pos} remain in the sample")
        try:
            sample[field] = decode_field(kind, view[pos:pos + size])
        except ReaderError as exc:
            raise ReaderError(f"field {field!r}: {exc}") from None
        pos += size
    if pos != n:
        raise ReaderError(f"sample has {n - pos} trailing bytes after its last field")
    return sample


_FIXED_KINDS = {"int": "<i8", "float": "<f8"}


def decode_uniform(block: memoryview, offset: int, length: int, count: int, schema: Schema,
                   pick: Sequence[int] | None = None, copy: bool = False) -> list[Sample] | None:
    """Decode ``count`` consecutive samples of ``length`` bytes each from ``block[offset:]`` at
    once, or None when that fast path does not apply (a bytes/str field, or samples whose field
    sizes or array headers differ; decode them one by one then). ``pick``: only the samples at
    these positions (0 .. count - 1, in this order), all ``count`` checked.

    The result is exactly what :func:`decode_sample` gives for each sample: sample 0 is decoded
    (and validated) normally, and every other sample is checked to carry byte-identical length
    prefixes and array headers, so only the values differ. Arrays are views of ``block``, or with
    ``copy`` of one new array holding the (picked) samples' bytes: one copy for them all, which
    no later use of ``block`` changes and which lives as long as any of their arrays.
    """
    if count < 2 or any(kind not in _FIXED_KINDS and kind != "ndarray" for kind in schema.values()):
        return None
    first = decode_sample(block[offset:offset + length], schema)
    rows = np.frombuffer(block, np.uint8, count * length, offset).reshape(count, length)
    spans: list[tuple[str, str, int, int]] = []  # where each field's value lies in a sample
    pos = 0
    for field, kind in schema.items():
        size = _U64.unpack_from(block, offset + pos)[0]
        start = pos + 8 + (size - (first[field].nbytes if kind == "ndarray" else 8))
        # the bytes before the value (length prefix, array header) must equal sample 0's
        if start > pos and not (rows[1:, pos:start] == rows[0, pos:start]).all():
            return None
        pos += 8 + size
        spans.append((field, kind, start, pos))
    at: Sequence[int] = range(count) if pick is None else pick
    if copy:  # the samples' rows into one array of their own; positions then index it
        rows = rows[np.asarray(at, dtype=np.intp)] if pick is not None else rows.copy()
        count, at, pick = len(rows), range(len(rows)), None
    columns: list[list[Any]] = []
    for field, kind, start, end in spans:
        if kind == "ndarray":
            v0 = first[field]
            col = rows[:, start:end].view(v0.dtype) if end > start else np.empty((count, 0), v0.dtype)
            col = col.reshape(count, *v0.shape)
            # views; 0-d stay arrays
            columns.append(list(col) if pick is None and v0.ndim else [col[i, ...] for i in at])
        else:
            values = rows[:, start:end].view(_FIXED_KINDS[kind]).reshape(count).tolist()
            columns.append(values if pick is None else [values[i] for i in at])
    names = list(schema)
    return [dict(zip(names, values)) for values in zip(*columns)]


def owned(sample: Any) -> Any:
    """A copy of ``sample`` that shares no buffer with it: arrays copied, immutable values (bytes,
    str, numbers) kept, containers copied through, anything else deep-copied."""
    if isinstance(sample, dict):
        return {k: owned(v) for k, v in sample.items()}
    if isinstance(sample, np.ndarray):
        return sample.copy()
    if sample is None or isinstance(sample, (bytes, str, int, float, bool)):
        return sample
    return copy.deepcopy(sample)


def schema_to_json(schema: Schema) -> str:
    """Serialize a schema (field order is preserved)."""
    return json.dumps(schema, separators=(",", ":"))


def schema_from_json(text: str | bytes, path: str | None = None) -> Schema:
    """Parse and validate a stored schema; :class:`ReaderError` naming ``path`` if invalid."""
    try:
        return check_schema(json.loads(text))
    except (ValueError, TypeError) as exc:
        raise ReaderError(f"stored datacache schema is invalid ({exc})", path=path,
                          hint="The shard is corrupt; rewrite it with the dataset writer") from None
