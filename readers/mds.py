"""MosaicML Streaming (MDS) shards, read in place, without the ``streaming`` package.

An MDS shard is a sample table (:mod:`readers._sampletable`), plain (``raw_data``) or compressed
whole (``zip_data``: ``zstd``, ``gz``, ``bz2``, ``snappy``, ``br``). A sample is, per column of
variable size, its ``u32`` size, then the columns' bytes in column order. The columns (names,
encodings, fixed sizes) are not in the shard but in the dataset's ``index.json``: the reader takes
them as ``columns=[[name, encoding, size or None], ...]`` (``datacache index`` records them in the
manifest's ``extra["reader_options"]``, which datacache passes to the reader).

Values, per MDS encoding, as Streaming's own reader gives them:

* ``bytes`` -> bytes, ``str`` -> str, ``int``/``str_int`` -> int, ``str_float`` -> float,
  ``str_decimal`` -> ``decimal.Decimal``, ``json`` -> the parsed value;
* ``uint8`` ... ``int64``, ``float16`` ... ``float64`` -> a numpy scalar of that dtype;
* ``ndarray`` (``ndarray:<dtype>`` and ``ndarray:<dtype>:<shape>`` too) -> an ndarray of that dtype
  and shape (writable, unlike Streaming's);
* ``jpeg``, ``png``, ``pil`` -> the encoded bytes as stored, or with ``decode_images=True`` a
  ``PIL.Image`` (as Streaming: ``Image.open`` / ``Image.frombytes``); ``list[jpeg]``, ``list[png]``,
  ``list[pil]``, ``jpeg_array`` -> a list of those;
* ``pkl`` -> refused (:class:`ReaderError`) unless ``allow_pickle=True``: unpickling runs code.

Not thread-safe: one reader per thread.
"""
from __future__ import annotations

import decimal
import io
import json
import os
import pickle
from typing import Any, Callable, Sequence

import numpy as np

from ._sampletable import PICKLE_REFUSED, SampleTable, no_writer, table_layout
from .base import ShardFormat
from .codec import Sample, Schema
from .errors import ReaderError, RefusedContentError

__all__ = ["MDSShardReader", "FORMAT", "ENCODINGS", "field_kind"]

_SCALARS = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
            "float16", "float32", "float64")
_SHAPE_DTYPES = ("uint8", "uint16", "uint32", "uint64")
_VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32",
                 33: "int32", 34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
_IMAGES = ("jpeg", "png", "pil")
_LISTS = {"list[jpeg]": "jpeg", "list[png]": "png", "list[pil]": "pil", "jpeg_array": "jpeg", "jpegarray": "jpeg"}
ENCODINGS = ("bytes", "str", "int", "ndarray", *_SCALARS, "str_int", "str_float", "str_decimal", *_IMAGES,
             *_LISTS, "json", "pkl")
_KINDS = {"bytes": "bytes", "str": "str", "int": "int", "str_int": "int", "str_float": "float", "float64": "float",
          "ndarray": "ndarray"}


def field_kind(encoding: str) -> str:
    """The kind a manifest records for a column of this MDS encoding: a datacache kind where the
    values are one (``int`` -> ``int``, ``ndarray:...`` -> ``ndarray``), else the encoding."""
    return _KINDS.get(encoding.split(":", 1)[0], encoding)


def _u32(raw: memoryview, pos: int) -> int:
    return int.from_bytes(raw[pos:pos + 4], "little")


def _ndarray(spec: str) -> Callable[[memoryview], np.ndarray]:
    """The decoder of ``ndarray[:dtype[:shape]]`` (Streaming's ``NDArray``)."""
    args = spec.split(":")[1:]
    if len(args) > 2 or (args and args[0] not in _VALUE_DTYPES.values()):
        raise ValueError(f"bad ndarray encoding {spec!r}")
    fixed_dtype = np.dtype(args[0]) if args else None
    fixed_shape = tuple(int(d) for d in args[1].split(",")) if len(args) == 2 else None

    def decode(raw: memoryview) -> np.ndarray:
        pos, dtype = 0, fixed_dtype
        if dtype is None:
            dtype, pos = np.dtype(_VALUE_DTYPES[raw[0]]), 1
        shape = fixed_shape
        if shape is None:
            ndim, shape_dtype = raw[pos] >> 2, np.dtype(_SHAPE_DTYPES[raw[pos] % 4])
            pos += 1
            shape = tuple(np.frombuffer(raw, shape_dtype, ndim, pos).tolist())
            pos += ndim * shape_dtype.itemsize
        return np.frombuffer(raw, dtype, offset=pos).reshape(shape)
    return decode


def _pil(raw: memoryview) -> Any:
    from PIL import Image

    width, height, mode_size = np.frombuffer(raw, "<u4", 3).tolist()
    mode = str(raw[12:12 + mode_size], "utf-8")
    return Image.frombytes(mode, (width, height), bytes(raw[12 + mode_size:]))


def _opened(raw: memoryview) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(bytes(raw)))


def _image(kind: str, decode: bool) -> Callable[[memoryview], Any]:
    if not decode:
        return bytes
    return _pil if kind == "pil" else _opened


def _list_of(kind: str, decode: bool, jpeg_array: bool) -> Callable[[memoryview], list[Any]]:
    one = _image(kind, decode)

    def decode_list(raw: memoryview) -> list[Any]:
        pos = 0 if jpeg_array else 4  # Streaming's lists start with a u32 placeholder
        n = _u32(raw, pos)
        sizes = np.frombuffer(raw, "<u4", n, pos + 4).tolist()
        pos += 4 + 4 * n
        out = []
        for size in sizes:
            out.append(one(raw[pos:pos + size]))
            pos += size
        return out
    return decode_list


def _pickle_refused(name: str) -> Callable[[memoryview], Any]:
    def refuse(raw: memoryview) -> Any:
        raise RefusedContentError(f"column {name!r} is pickled (MDS encoding 'pkl'): {PICKLE_REFUSED}")
    return refuse


def _decoder(name: str, encoding: str, decode_images: bool, allow_pickle: bool) -> Callable[[memoryview], Any]:
    base = encoding.split(":", 1)[0]
    if base == "ndarray":
        return _ndarray(encoding)
    if base in _SCALARS:
        dtype = np.dtype(base)
        return lambda raw: np.frombuffer(raw, dtype, 1)[0]
    if base in _IMAGES:
        return _image(base, decode_images)
    if base in _LISTS:
        return _list_of(_LISTS[base], decode_images, jpeg_array=base.startswith("jpeg"))
    if base == "pkl":
        return (lambda raw: pickle.loads(raw)) if allow_pickle else _pickle_refused(name)  # noqa: S301
    simple: dict[str, Callable[[memoryview], Any]] = {
        "bytes": bytes, "str": lambda raw: str(raw, "utf-8"),
        "int": lambda raw: int.from_bytes(raw, "little", signed=True),
        "str_int": lambda raw: int(str(raw, "utf-8")), "str_float": lambda raw: float(str(raw, "utf-8")),
        "str_decimal": lambda raw: decimal.Decimal(str(raw, "utf-8")),
        "json": lambda raw: json.loads(str(raw, "utf-8")),
    }
    if base not in simple:
        raise ValueError(f"unknown MDS encoding {encoding!r}")
    return simple[base]


class MDSShardReader(SampleTable):
    """Read an MDS shard (see the module docstring). ``columns``: ``[name, encoding, size]`` per
    column, from the shard's entry in ``index.json``; ``compression``: its ``compression``
    (``None`` for a ``raw_data`` file); ``decode_images``; ``allow_pickle``."""

    _WHAT = "MDS shard"

    def __init__(self, path: str | os.PathLike[str], *, columns: Sequence[Sequence[Any]] | None = None,
                 compression: str | None = None, decode_images: bool = False, allow_pickle: bool = False) -> None:
        super().__init__(path, compression=compression)
        if not columns:
            raise ReaderError("an MDS shard needs its columns (name, encoding, size) from index.json",
                              path=self.path, hint="Index the dataset with `datacache index URL`, which records them")
        try:
            self._names = [str(c[0]) for c in columns]
            self._fixed = [None if c[2] is None else int(c[2]) for c in columns]
            self._decoders = [_decoder(str(c[0]), str(c[1]), decode_images, allow_pickle) for c in columns]
        except (ValueError, TypeError, IndexError) as exc:
            raise ReaderError(f"bad MDS columns {columns!r} ({exc})", path=self.path,
                              hint="Rebuild the manifest with `datacache index`") from None
        self.schema = {str(c[0]): field_kind(str(c[1])) for c in columns}
        self._ensure_open()

    def field_kinds(self) -> Schema:
        return dict(self.schema or {})

    def _decode(self, raw: memoryview, index: int) -> Sample:
        pos, sizes = 0, []
        for fixed in self._fixed:
            if fixed is None:
                fixed, pos = _u32(raw, pos), pos + 4
            sizes.append(fixed)
        if pos + sum(sizes) != len(raw):
            raise ReaderError(f"columns of {pos + sum(sizes)} bytes in all, but the sample has {len(raw)}")
        sample: Sample = {}
        for name, size, decode in zip(self._names, sizes, self._decoders):
            sample[name] = decode(raw[pos:pos + size])
            pos += size
        return sample


FORMAT = ShardFormat(name="mds", extension=".mds", reader=MDSShardReader,
                     ShardWriter=no_writer("MosaicML Streaming (MDS)"), writes=False, layout=table_layout)
