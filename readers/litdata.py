"""LitData chunks (``litdata.optimize`` output), read in place, without the ``litdata`` package.

A chunk is a sample table (:mod:`readers._sampletable`), plain or compressed whole (``zstd``). An
item is, per leaf of its pytree, a ``u32`` size, then the leaves' bytes; the leaves' serializers
(``data_format``) and the tree (``data_spec``, LitData's pytree JSON) are in the dataset's
``index.json`` ``config``: the reader takes them as ``data_format=[...]`` and ``data_spec="..."``
(``datacache index`` records them in the manifest's ``extra["reader_options"]``).

Items come back in LitData's structure (dicts, lists, tuples, OrderedDicts) with LitData's values:
``int`` -> int, ``float`` -> float, ``bool`` -> bool, ``str`` -> str, ``bytes`` -> bytes,
``numpy`` and ``no_header_numpy:<dtype>`` -> an ndarray of that dtype and shape (writable),
``tensor`` and ``no_header_tensor:<dtype>`` -> a ``torch.Tensor`` (torch is imported only then);
``json`` (a nested list or dict leaf, in LitData's compact encoding or as JSON text) -> its value;
``jpeg``, ``pil`` -> the encoded bytes, or with ``decode_images=True`` a ``PIL.Image`` (LitData
decodes ``jpeg`` to a tensor through torchvision; datacache does not use torchvision);
``pickle`` -> refused (:class:`ReaderError`) unless ``allow_pickle=True``: unpickling runs code.
Other serializers (video, audio, image, ...), LitData's other item loaders (tokens, Parquet) and
encryption are refused, and so is ``compression_level="sample"``. Compressed chunks (``zstd``,
``"chunk"``: the whole file, ``"batch"``: LitData's framed layout, its default) are inflated into a
plain sample table when the reader opens, and held in memory while it is open.

Not thread-safe: one reader per thread.
"""
from __future__ import annotations

import collections
import io
import json
import os
import pickle
import struct
from typing import Any, Callable, Sequence

import numpy as np

from ._sampletable import PICKLE_REFUSED, SampleTable, decompress, no_writer, table_layout
from .base import ShardFormat
from .codec import Schema
from .errors import HINT_CORRUPT, ReaderError, RefusedContentError

__all__ = ["LitDataChunkReader", "FORMAT", "SERIALIZERS", "unflatten"]

# LitData's _NUMPY_DTYPES_MAPPING (index -> dtype), without object/bytes/str/void
_NUMPY = [np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
                                np.float16, np.float32, np.float64, np.complex64, np.complex128, bool)]
# LitData's _TORCH_DTYPES_MAPPING (index -> torch dtype name)
_TORCH = ("float32", "float", "float64", "double", "complex64", "cfloat", "complex128", "cdouble", "float16", "half",
          "bfloat16", "uint8", "int8", "int16", "short", "int32", "int", "int64", "long", "bool", "uint16")
_TENSOR_HEAD = struct.Struct(">II")
SERIALIZERS = ("int", "float", "bool", "str", "bytes", "numpy", "no_header_numpy", "tensor", "no_header_tensor",
               "json", "jpeg", "pil", "pickle")
_KINDS = {"int": "int", "float": "float", "str": "str", "bytes": "bytes", "numpy": "ndarray",
          "no_header_numpy": "ndarray", "tensor": "tensor", "no_header_tensor": "tensor", "bool": "bool"}


def _numpy(raw: memoryview) -> np.ndarray:
    dtype, ndim = np.frombuffer(raw, "<u4", 2).tolist()
    shape = tuple(np.frombuffer(raw, "<u4", ndim, 8).tolist())
    return np.frombuffer(raw, _NUMPY[dtype], offset=8 + 4 * ndim).reshape(shape)


def _torch_dtype(index: int) -> Any:
    import torch

    return getattr(torch, _TORCH[index])


def _tensor(raw: memoryview) -> Any:
    import torch

    dtype, rank = _TENSOR_HEAD.unpack_from(raw, 0)
    shape = struct.unpack_from(f">{rank}I", raw, 8)
    data = raw[8 + 4 * rank:]
    if not len(data):
        return torch.empty(shape, dtype=_torch_dtype(dtype))
    return torch.frombuffer(data, dtype=_torch_dtype(dtype)).reshape(shape)


def _no_header_tensor(dtype: Any) -> Callable[[memoryview], Any]:
    import torch

    return lambda raw: torch.frombuffer(raw, dtype=dtype) if len(raw) else torch.empty((0,), dtype=dtype)


def _image(name: str, decode: bool) -> Callable[[memoryview], Any]:
    if not decode:
        return bytes

    def opened(raw: memoryview) -> Any:
        from PIL import Image

        if name == "jpeg":
            return Image.open(io.BytesIO(bytes(raw)))
        width, height, mode_size = np.frombuffer(raw, "<u4", 3).tolist()
        return Image.frombytes(str(raw[12:12 + mode_size], "utf-8"), (width, height), bytes(raw[12 + mode_size:]))
    return opened


_U32, _I64, _F64 = struct.Struct("<I"), struct.Struct("<q"), struct.Struct("<d")
_SCALAR_TAGS = {7: "str", 8: _I64, 9: _F64, 10: "bool", 11: None}  # LitData's _NEST_STR ... _NEST_NONE
_ARRAY_TAGS = {2: "<i8", 3: "<f8"}  # _NEST_I64S, _NEST_F64S


def _utf8(raw: memoryview, pos: int) -> tuple[str, int]:
    n = _U32.unpack_from(raw, pos)[0]
    return str(raw[pos + 4:pos + 4 + n], "utf-8"), pos + 4 + n


def _scalar(tag: int, raw: memoryview, pos: int) -> tuple[Any, int]:
    """A scalar of LitData's nested encoding (a record's cell tags are these tags + 9)."""
    kind = _SCALAR_TAGS[tag]
    if kind == "str":
        return _utf8(raw, pos)
    if kind == "bool":
        return raw[pos] != 0, pos + 1
    if kind is None:
        return None, pos
    return kind.unpack_from(raw, pos)[0], pos + 8


def _nested_at(raw: memoryview, pos: int) -> tuple[Any, int]:
    """One value of LitData's compact nested encoding (its ``json`` serializer) at ``pos``."""
    tag, pos = raw[pos], pos + 1
    if tag in _SCALAR_TAGS:
        return _scalar(tag, raw, pos)
    n, pos = _U32.unpack_from(raw, pos)[0], pos + 4
    if tag == 0:  # JSON text
        return json.loads(str(raw[pos:pos + n], "utf-8")), pos + n
    if tag in _ARRAY_TAGS:
        return np.frombuffer(raw, _ARRAY_TAGS[tag], n, pos).tolist(), pos + 8 * n
    if tag == 4:  # bools
        return [b != 0 for b in raw[pos:pos + n]], pos + n
    if tag == 1:  # strings
        out = []
        for _ in range(n):
            text, pos = _utf8(raw, pos)
            out.append(text)
        return out, pos
    if tag == 5:  # a dict with str keys
        mapping: dict[str, Any] = {}
        for _ in range(n):
            key, pos = _utf8(raw, pos)
            mapping[key], pos = _nested_at(raw, pos)
        return mapping, pos
    if tag == 6:  # records: dicts of the same str keys and scalar values
        width, pos = _U32.unpack_from(raw, pos)[0], pos + 4
        keys = []
        for _ in range(width):
            key, pos = _utf8(raw, pos)
            keys.append(key)
        rows = []
        for _ in range(n):
            row: dict[str, Any] = {}
            for key in keys:
                cell, pos = raw[pos], pos + 1
                row[key], pos = _scalar({0x10: 11, 0x11: 7, 0x12: 8, 0x13: 9, 0x14: 10}[cell], raw, pos)
            rows.append(row)
        return rows, pos
    raise ValueError(f"unknown tag {tag} in a LitData json leaf")


def _nested(raw: memoryview) -> Any:
    """A LitData ``json`` leaf: its compact nested encoding, or (older files) JSON text."""
    if not len(raw) or raw[0] > 0x20:
        return json.loads(str(raw, "utf-8"))
    return _nested_at(raw, 0)[0]


def _leaf(fmt: str, index: int, decode_images: bool, allow_pickle: bool) -> Callable[[memoryview], Any]:
    name, _, arg = fmt.partition(":")
    if name == "no_header_numpy":
        dtype = _NUMPY[int(arg)]
        return lambda raw: np.frombuffer(raw, dtype)
    if name == "no_header_tensor":
        return _no_header_tensor(_torch_dtype(int(arg)))
    if name in ("jpeg", "pil"):
        return _image(name, decode_images)
    if name == "pickle":
        if allow_pickle:
            return lambda raw: pickle.loads(raw)  # noqa: S301

        def refuse(raw: memoryview) -> Any:
            raise RefusedContentError(f"leaf {index} of the item is pickled (LitData serializer 'pickle'): "
                                      f"{PICKLE_REFUSED}")
        return refuse
    simple: dict[str, Callable[[memoryview], Any]] = {
        "int": lambda raw: struct.unpack("<q", raw)[0], "float": lambda raw: struct.unpack("<d", raw)[0],
        "bool": lambda raw: raw[0] != 0, "str": lambda raw: str(raw, "utf-8"), "bytes": bytes,
        "numpy": _numpy, "tensor": _tensor, "json": _nested,
    }
    if name not in simple:
        raise ValueError(f"LitData serializer {fmt!r} is not one datacache reads ({', '.join(SERIALIZERS)})")
    return simple[name]


_CONTAINERS: dict[str, Callable[[Any, list[Any]], Any]] = {
    "builtins.dict": lambda keys, values: dict(zip(keys, values)),
    "collections.OrderedDict": lambda keys, values: collections.OrderedDict(zip(keys, values)),
    "builtins.list": lambda _, values: list(values),
    "builtins.tuple": lambda _, values: tuple(values),
}


def _check_spec(node: Any) -> int:
    """The number of leaves of a pytree spec node (``ValueError`` for a node type not read)."""
    if node["type"] is None:
        return 1
    if node["type"] not in _CONTAINERS:
        raise ValueError(f"pytree node type {node['type']!r} is not one datacache rebuilds "
                         f"({', '.join(_CONTAINERS)})")
    return sum(_check_spec(child) for child in node["children_spec"])


def unflatten(leaves: Sequence[Any], spec: Any) -> Any:
    """LitData's ``tree_unflatten`` of ``leaves`` by the loaded ``data_spec`` (``[1, node]``)."""
    it = iter(leaves)

    def build(node: Any) -> Any:
        if node["type"] is None:
            return next(it)
        values = [build(child) for child in node["children_spec"]]
        return _CONTAINERS[node["type"]](json.loads(node["context"]), values)
    return build(spec[1])


_FRAMED = struct.Struct("<8sHHIII")  # magic, version, flags, items, rows per frame, frames
_FRAME = struct.Struct("<IIQII")  # first item, items, compressed offset, compressed size, size
_FRAMED_MAGIC = b"LDFZ01\0\0"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _table(sizes: list[int], payload: bytes) -> bytes:
    """A plain sample table of items of ``sizes`` bytes, ``payload`` their concatenation."""
    n = len(sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]) + 4 + 4 * (n + 1)
    if offsets[-1] >= 1 << 32:
        raise ValueError("the chunk is 4 GiB or more uncompressed")
    return b"".join((struct.pack("<I", n), offsets.astype("<u4").tobytes(), payload))


def _unframe(data: bytes, path: str) -> bytes:
    """LitData's framed zstd chunk (``compression_level="batch"``: LDFZ01) as a plain sample table."""
    magic, version, _, n, _, n_frames = _FRAMED.unpack_from(data, 0)
    if magic != _FRAMED_MAGIC or version != 1:
        raise ValueError(f"not a LitData framed zstd chunk (magic {magic!r}, version {version})")
    offsets = np.frombuffer(data, "<u4", n + 1, _FRAMED.size).astype(np.int64)
    parts, pos = [], _FRAMED.size + 4 * (n + 1)
    for k in range(n_frames):
        _, _, start, size, plain = _FRAME.unpack_from(data, pos + k * _FRAME.size)
        parts.append(decompress("zstd", data[start:start + size], path))
        if len(parts[-1]) != plain:
            raise ValueError(f"frame {k} inflates to {len(parts[-1])} bytes, its table says {plain}")
    payload = b"".join(parts)
    if offsets[0] != 0 or offsets[-1] != len(payload) or (np.diff(offsets) < 0).any():
        raise ValueError("the item offsets do not match the frames")
    return _table(np.diff(offsets).tolist(), payload)


class LitDataChunkReader(SampleTable):
    """Read a LitData chunk (see the module docstring). ``data_format``, ``data_spec``: from the
    ``config`` of ``index.json``; ``compression``: its ``compression`` (``None``: plain)."""

    _WHAT = "LitData chunk"

    def __init__(self, path: str | os.PathLike[str], *, data_format: Sequence[str] | None = None,
                 data_spec: str | None = None, compression: str | None = None, compression_level: str | None = None,
                 decode_images: bool = False, allow_pickle: bool = False) -> None:
        super().__init__(path, compression=compression)
        if compression_level not in (None, "chunk", "batch"):
            raise ReaderError(f"LitData compression_level {compression_level!r} is not one datacache reads",
                              path=self.path, hint="datacache reads 'chunk' and 'batch' (LitData's default)")
        self._level = compression_level
        if not data_format:
            raise ReaderError("a LitData chunk needs the data_format and data_spec of its index.json",
                              path=self.path, hint="Index the dataset with `datacache index URL`, which records them")
        try:
            self._spec = json.loads(data_spec) if data_spec else [1, {"type": None}]
            leaves = _check_spec(self._spec[1])
            if leaves != len(data_format):
                raise ValueError(f"data_spec has {leaves} leaves but data_format {len(data_format)}")
            self._leaves = [_leaf(str(f), i, decode_images, allow_pickle) for i, f in enumerate(data_format)]
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise ReaderError(f"cannot read this LitData dataset: {exc}", path=self.path,
                              hint="Rebuild the manifest with `datacache index`, or convert the dataset") from None
        self._sizes = struct.Struct(f"<{len(data_format)}I")
        self.schema = {f"leaf{i}": _KINDS.get(str(f).split(":", 1)[0], str(f)) for i, f in enumerate(data_format)}
        self._ensure_open()

    def field_kinds(self) -> Schema:
        return dict(self.schema or {})

    def _inflate(self, data: bytes) -> bytes:
        """LitData compresses a chunk as ``compression_level`` says, except where it did not (a chunk
        of dict items may carry an Arrow footer instead): so each chunk's own bytes tell."""
        try:
            if data[:8] == _FRAMED_MAGIC:  # "batch"
                return _unframe(data, self.path)
            if data[:4] == _ZSTD_MAGIC:  # "chunk": the whole file (a .zstd.bin chunk)
                return super()._inflate(data)
            return data
        except (ValueError, struct.error) as exc:
            raise ReaderError(f"not a LitData chunk compressed by {self._level!r} ({exc})", path=self.path,
                              hint=HINT_CORRUPT) from None

    def _decode(self, raw: memoryview, index: int) -> Any:
        sizes = self._sizes.unpack_from(raw, 0)
        pos = self._sizes.size
        if pos + sum(sizes) != len(raw):
            raise ReaderError(f"leaves of {pos + sum(sizes)} bytes in all, but the item has {len(raw)}")
        leaves = []
        for size, decode in zip(sizes, self._leaves):
            leaves.append(decode(raw[pos:pos + size]))
            pos += size
        return unflatten(leaves, self._spec)


FORMAT = ShardFormat(name="litdata", extension=".bin", reader=LitDataChunkReader,
                     ShardWriter=no_writer("LitData"), writes=False, layout=table_layout)
