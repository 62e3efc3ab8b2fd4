"""Tar shards in the WebDataset layout (uncompressed tar).

Members are grouped into samples by key: the member path up to the first ``.`` of its basename
(``a/b/000001.jpg`` and ``a/b/000001.cls`` -> key ``a/b/000001``, fields ``jpg`` and ``cls``);
consecutive members with the same key form one sample, which also gets ``"__key__"`` (str).
Members without an extension are skipped, as WebDataset does.

Writer: a first member ``__datacache_schema__.json`` holds the schema, then members
``{index:08d}.{field}``: ``bytes`` raw, ``str`` UTF-8, ``int``/``float`` as decimal text
(``repr``, exact), ``ndarray`` as :func:`readers.codec.encode_field` bytes. The reader uses that
schema to decode fields; without it (any WebDataset tar) every field comes back as ``bytes``.

The reader indexes member data offsets on open (headers only) and ``get(i)`` reads just that
sample's bytes. Nothing is ever extracted. Members with absolute names, ``..`` components,
backslashes or NUL, links, devices, FIFOs, sparse files, sizes beyond the file, and archives
not ending in an end-of-archive block raise :class:`ReaderError`.

Thread safety: one reader or writer per thread.
"""
from __future__ import annotations

import io
import os
import re
import tarfile
from typing import Any, Iterator

from .base import ReadRange, ShardFormat
from .base import ShardReader as _BaseReader
from .base import ShardWriter as _BaseWriter
from .codec import Sample, Schema, decode_field, encode_field, schema_from_json, schema_to_json
from .errors import HINT_CORRUPT, HINT_FORMAT, ReaderError

__all__ = ["TarShardReader", "TarShardWriter", "FORMAT", "SCHEMA_MEMBER", "member_key", "probe"]

SCHEMA_MEMBER = "__datacache_schema__.json"
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$", re.DOTALL)  # WebDataset's base_plus_ext
_BLOCK = 512
_MAX_SCHEMA_BYTES = 1 << 20
_HINT_UNSAFE = "Refusing a hostile or unsupported tar; rebuild the shard with plain files only"
_Members = list[tuple[str, int, int]]  # (field, data offset, size)


def _encode_text(kind: str, value: Any) -> bytes:
    if kind == "int":
        return str(int(value)).encode("ascii")
    if kind == "float":
        return repr(float(value)).encode("ascii")
    return encode_field(kind, value)


def _decode_text(kind: str, raw: bytes | bytearray) -> Any:
    try:
        if kind == "int":
            return int(raw.decode("ascii"))
        if kind == "float":
            return float(raw.decode("ascii"))
    except ValueError as exc:  # also UnicodeDecodeError
        raise ReaderError(f"{kind} field is not decimal text ({exc})") from None
    return decode_field(kind, raw)


def member_key(name: str) -> tuple[str, str] | None:
    """``(key, field)`` of a member path as WebDataset groups it (``a/0001.jpg`` -> ``("a/0001",
    "jpg")``), or None for a name without an extension (skipped)."""
    match = _KEY_RE.match(name)
    return None if match is None else (match.group(1), match.group(2))


def probe(read_range: ReadRange, size: int, name: str) -> None:
    """Check that a file starts with a tar header (one 512-byte read); :class:`ReaderError`
    naming ``name`` if not. The sample count needs the whole file: None."""
    head = read_range(0, min(_BLOCK, size))
    try:
        tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
    except tarfile.EOFHeaderError:  # an empty archive
        pass
    except tarfile.HeaderError as exc:
        raise ReaderError(f"not a tar file ({exc})", path=name) from None
    return None


class _BoundedFile(io.RawIOBase):
    """A read-only file view whose ``read(n)`` never asks for more than what remains, so a
    header declaring a huge (PAX/GNU long name) size cannot make ``tarfile`` allocate it."""

    def __init__(self, fd: int, size: int) -> None:
        super().__init__()
        self._fd, self._size, self._pos = fd, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        n = self._size - self._pos if n is None or n < 0 else n
        data = os.pread(self._fd, max(0, min(n, self._size - self._pos)), self._pos)
        self._pos += len(data)
        return data


class TarShardWriter(_BaseWriter):
    """Write a WebDataset-style tar shard (PAX format, mtime 0, mode 0444)."""

    def __init__(self, path: str | os.PathLike[str], schema: Schema) -> None:
        super().__init__(path, schema)
        for field in self.schema:
            if field.startswith("__") or any(c in field for c in "/\\"):
                raise ValueError(f"field {field!r} cannot name a tar member extension "
                                 f"(no '/', '\\' or leading '__')")
        self._tar = tarfile.open(self.tmp_path, "w", format=tarfile.PAX_FORMAT)
        self._add(SCHEMA_MEMBER, schema_to_json(self.schema).encode("utf-8"))

    def _add(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o444
        self._tar.addfile(info, io.BytesIO(data))

    def _write(self, sample: Sample) -> int:
        key, size = f"{self.samples_written:08d}", 0
        for field, kind in self.schema.items():
            data = _encode_text(kind, sample[field])
            self._add(f"{key}.{field}", data)
            size += len(data)
        return size

    def _finish(self) -> None:
        self._tar.close()

    def _discard(self) -> None:
        self._tar.close()


class TarShardReader(_BaseReader):
    """Read a tar shard by seeking to indexed member data. Not thread-safe."""

    _HANDLE_ATTRS = ("_file",)

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._file: io.FileIO | None = None
        self._size = -1
        self._samples: list[tuple[str, _Members]] = []
        self._ensure_open()

    def _corrupt(self, what: str, hint: str = HINT_CORRUPT) -> ReaderError:
        return ReaderError(what, path=self.path, hint=hint)

    def _open_handles(self) -> None:
        self._file = io.FileIO(self.path, "r")
        size = os.fstat(self._file.fileno()).st_size
        if self._size < 0:
            self._build_index(self._file.fileno(), size)
            self._size = size
        elif size != self._size:
            raise self._corrupt(f"file size changed from {self._size} to {size} bytes")

    def _close_handles(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None

    def _build_index(self, fd: int, size: int) -> None:
        try:
            tar = tarfile.open(fileobj=_BoundedFile(fd, size), mode="r:")
        except (tarfile.TarError, ValueError, OverflowError) as exc:
            raise ReaderError(f"not a tar shard (bad header at offset 0: {exc})", path=self.path,
                              hint=HINT_FORMAT) from None
        first = True
        while True:
            try:
                info = tar.next()
            except Exception as exc:  # untrusted headers: tarfile raises many types
                raise self._corrupt(f"bad tar header near offset {tar.offset} ({exc})") from None
            if info is None:
                break
            self._check_member(info, size)
            self._index_member(info, first)
            first = False
        if os.pread(fd, _BLOCK, tar.offset) != bytes(_BLOCK):
            raise self._corrupt(f"truncated tar shard: no end-of-archive block at offset "
                                f"{tar.offset}")

    def _check_member(self, info: tarfile.TarInfo, size: int) -> None:
        name = info.name
        if not name or name.startswith("/") or "\\" in name or "\x00" in name \
                or ".." in name.split("/"):
            raise self._corrupt(f"unsafe tar member name {name!r}", _HINT_UNSAFE)
        if info.isdir():
            return
        if not info.isreg() or info.issparse():
            raise self._corrupt(f"tar member {name!r} is not a regular file (type "
                                f"{info.type!r}); links and devices are refused", _HINT_UNSAFE)
        if info.size < 0 or info.offset_data + info.size > size:
            raise self._corrupt(f"truncated tar shard: member {name!r} declares {info.size} "
                                f"bytes at offset {info.offset_data}, beyond the file size {size}")

    def _index_member(self, info: tarfile.TarInfo, first: bool) -> None:
        if info.isdir():
            return
        if info.name == SCHEMA_MEMBER:
            if first:
                self._load_schema(info)
            return
        split = member_key(info.name)
        if split is None:  # no extension: skipped, as WebDataset does
            return
        key, field = split
        if not self._samples or self._samples[-1][0] != key:
            self._samples.append((key, []))
        members = self._samples[-1][1]
        if any(f == field for f, _, _ in members):
            raise self._corrupt(f"duplicate tar member {info.name!r} in sample {key!r}")
        members.append((field, info.offset_data, info.size))

    def _load_schema(self, info: tarfile.TarInfo) -> None:
        if info.size > _MAX_SCHEMA_BYTES:
            raise self._corrupt(f"{SCHEMA_MEMBER} is {info.size} bytes, too large")
        self.schema = schema_from_json(self._read(info.offset_data, info.size), self.path)

    def _read(self, offset: int, size: int, writable: bool = False) -> bytes | bytearray:
        """``size`` bytes at ``offset``; into a ``bytearray`` when ``writable`` (arrays decoded from
        it are then writable, at no extra copy)."""
        assert self._file is not None
        if writable:
            data: bytes | bytearray = bytearray(size)
            got = os.preadv(self._file.fileno(), [data], offset) if size else 0
        else:
            data = os.pread(self._file.fileno(), size, offset)
            got = len(data)
        if got != size:
            raise self._corrupt(f"truncated tar shard: short read at offset {offset}")
        return data

    def __len__(self) -> int:
        return len(self._samples)

    def field_kinds(self) -> Schema:
        """The stored schema, or for a plain WebDataset tar one ``bytes`` field per member
        extension, in order of first appearance (samples may lack some of them)."""
        if self.schema is not None:
            return dict(self.schema)
        return {field: "bytes" for _, members in self._samples for field, _, _ in members}

    def _get(self, index: int) -> Sample:
        key, members = self._samples[index]
        schema = self.schema or {}
        sample: Sample = {"__key__": key}
        for field, offset, size in members:
            kind = schema.get(field, "bytes")
            raw = self._read(offset, size, writable=kind == "ndarray")
            try:
                sample[field] = raw if kind == "bytes" else _decode_text(kind, raw)
            except ReaderError as exc:
                raise self._corrupt(f"sample {key!r} field {field!r}: {exc}") from None
        return sample

    def _iter_range(self, start: int, stop: int) -> Iterator[Sample]:
        for i in range(start, stop):
            yield self._get(i)


FORMAT = ShardFormat(name="tar", extension=".tar", reader=TarShardReader,
                     ShardWriter=TarShardWriter, probe=probe, union_schema=True)
