"""The sample table that MosaicML Streaming's MDS shards and LitData's chunks share, read in place.

Layout (little-endian): ``u32 count``, ``u32 offsets[count + 1]`` (absolute byte offsets of the
samples, the last one the end of the data), then the samples' bytes (MDS puts its config's JSON
between the offsets and the first sample). The whole file may be
compressed (an MDS ``zip_data`` file, a LitData chunk written with ``compression``): it is then
decompressed once, when the reader opens it, and held in memory while the reader is open.
A plain file has a layout (:func:`table_layout`: runs of samples of about 1 MB), so a cache may
fill it run by run and read samples before it is whole; a compressed one is read whole.

:class:`SampleTable` is the base of both readers: it validates the table (offsets ascending, within
the file, starting after the table) and hands each sample's bytes over as writable memory of its
own: a plain file's are read in place, through a copy-on-write map (:mod:`readers._cowmap`), an
inflated file's are copied out of it; so values decoded from them (arrays) are writable and an
in-place change never reaches the file or a later read. Subclasses
decode one sample from its bytes (:meth:`SampleTable._decode`).

Not thread-safe: one reader per thread (see :mod:`readers.base`).
"""
from __future__ import annotations

import bz2
import gzip
import io
import os
from typing import Any, Callable, Iterator

import numpy as np

from ._cowmap import CowMap
from .base import ReadRange, ShardLayout, ShardReader
from .codec import Sample
from .errors import HINT_CORRUPT, ReaderError, RefusedContentError

__all__ = ["SampleTable", "decompress", "COMPRESSIONS", "PICKLE_REFUSED", "no_writer", "table_layout", "UNIT_BYTES"]

# A unit of a plain file's layout: consecutive samples of about this many bytes (a dcz block's size)
UNIT_BYTES = 1 << 20

# One line, said wherever a pickled column or item is refused.
PICKLE_REFUSED = ("refused: unpickling a file from a bucket executes whatever code its writer put in it; "
                  "pass reader_options={'allow_pickle': True} only for a dataset you trust")


def no_writer(library: str) -> Callable[..., Any]:
    """A format's ``ShardWriter`` for files datacache reads in place but does not write."""
    def refuse(path: str | os.PathLike[str], schema: Any, **kw: Any) -> Any:
        raise ValueError(f"datacache reads {library} files in place but does not write them; "
                         f"write format 'zstd' (or parquet, tar, lmdb) instead")
    return refuse


def _offsets(count: int, offsets: np.ndarray, size: int) -> str | None:
    """What is wrong with a sample table's ``offsets`` for ``count`` samples in ``size`` bytes, or None."""
    if offsets[0] < 4 + 4 * (count + 1) or offsets[-1] > size or (np.diff(offsets) < 0).any():
        return f"offsets are not ascending within its {size} bytes"
    return None


def table_layout(read: ReadRange, size: int, name: str) -> ShardLayout:
    """Where a plain (uncompressed) sample table's samples lie (``ShardLayout``): its units are runs
    of consecutive samples of about ``UNIT_BYTES``; the count and offsets are read by every read.
    :class:`ReaderError` naming ``name`` for a file that is no sample table."""
    head = read(0, min(size, 4)) if size >= 8 else b""
    count = int(np.frombuffer(head, "<u4")[0]) if len(head) == 4 else -1
    if count < 0 or 4 + 4 * (count + 1) > size:
        raise ReaderError(f"not a sample table of {size} bytes", path=name, hint=HINT_CORRUPT)
    offsets = np.frombuffer(read(4, 8 + 4 * count), "<u4").astype(np.int64)
    problem = _offsets(count, offsets, size)
    if problem:
        raise ReaderError(f"sample table's {problem}", path=name, hint=HINT_CORRUPT)
    first, spans, start = [], [], 0
    while start < count:  # a unit: samples until UNIT_BYTES, at least one
        end = int(np.searchsorted(offsets, offsets[start] + UNIT_BYTES, side="left"))
        end = min(count, max(end, start + 1))
        first.append(start)
        spans.append((int(offsets[start]), int(offsets[end])))
        start = end
    return ShardLayout(size=size, samples=count, fixed=((0, 8 + 4 * count),), spans=tuple(spans),
                       first=tuple(first))


def _zstd(data: bytes) -> bytes:
    import zstandard  # a hard dependency of datacache (the dcz format)

    # a reader across frames, and no need of a content size in the frame header
    with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True) as r:
        return r.read()


def _brotli(data: bytes) -> bytes:
    import cramjam

    return bytes(cramjam.brotli.decompress(data))


def _snappy(data: bytes) -> bytes:
    import cramjam  # python-snappy's snappy.compress is raw (unframed) snappy: cramjam's *_raw

    return bytes(cramjam.snappy.decompress_raw(data))


# compression family (the part of "zstd:7" before the colon) -> decompressor
COMPRESSIONS = {"zstd": _zstd, "gz": gzip.decompress, "bz2": bz2.decompress, "br": _brotli, "snappy": _snappy}


def decompress(compression: str, data: bytes, path: str) -> bytes:
    """``data`` decompressed by the family of ``compression`` (``"zstd:7"``, ``"gz"`` ...);
    :class:`ReaderError` naming ``path`` for an unknown family or data that does not decompress."""
    family = compression.split(":", 1)[0]
    fn = COMPRESSIONS.get(family)
    if fn is None:
        raise ReaderError(f"unknown compression {compression!r}", path=path,
                          hint=f"datacache reads {', '.join(sorted(COMPRESSIONS))}")
    try:
        return fn(data)
    except Exception as exc:  # each library raises its own types
        raise ReaderError(f"does not decompress as {compression!r} ({type(exc).__name__}: {exc})", path=path,
                          hint=HINT_CORRUPT) from None


class SampleTable(ShardReader):
    """A shard holding a sample table (see the module docstring); ``compression``: the file's
    whole-file compression (``None``: plain). Subclasses implement :meth:`_decode`."""

    _HANDLE_ATTRS = ("_fd", "_data", "_cow")
    _WHAT = "sample table"

    def __init__(self, path: str | os.PathLike[str], *, compression: str | None = None) -> None:
        super().__init__(path)
        self.compression = compression or None
        self._fd: int | None = None
        self._data: bytes | None = None  # the decompressed file (compressed shards only)
        self._cow: CowMap | None = None  # a plain file, mapped copy-on-write
        self._offsets: list[int] = []
        self._size = -1

    def _corrupt(self, what: str) -> ReaderError:
        return ReaderError(what, path=self.path, hint=HINT_CORRUPT)

    def _open_handles(self) -> None:
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        size = os.fstat(self._fd).st_size
        if self.compression is not None:
            with os.fdopen(os.dup(self._fd), "rb") as f:
                self._data = self._inflate(f.read())
            size = len(self._data)
        if self._size < 0:
            self._load_table(size)
            self._size = size
        elif size != self._size:
            raise self._corrupt(f"file size changed from {self._size} to {size} bytes")
        if self._data is None:
            self._cow = CowMap(self._fd, size)  # samples read in place, writable, never into the file

    def _close_handles(self) -> None:
        if self._cow is not None:
            self._cow.close()
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._data, self._cow = None, None, None

    @property
    def held_bytes(self) -> int:
        """Memory this reader holds of its own: a compressed file's inflated copy, while open."""
        return len(self._data) if self._data is not None else 0

    def _pread(self, size: int, offset: int) -> bytearray:
        """``size`` bytes at ``offset`` of the (decompressed) file, in a new ``bytearray``."""
        if self._data is not None:
            out = bytearray(memoryview(self._data)[offset:offset + size])
        else:
            assert self._fd is not None
            out = bytearray(size)
            if size and os.preadv(self._fd, [out], offset) != size:
                raise self._corrupt(f"truncated {self._WHAT}: short read of {size} bytes at offset {offset}")
        if len(out) != size:
            raise self._corrupt(f"truncated {self._WHAT}: {size} bytes at offset {offset} are beyond its end")
        return out

    def _load_table(self, size: int) -> None:
        if size < 8:
            raise self._corrupt(f"{size} bytes is too small for a {self._WHAT}")
        count = int(np.frombuffer(self._pread(4, 0), "<u4")[0])
        if 4 + 4 * (count + 1) > size:
            raise self._corrupt(f"{self._WHAT} declares {count} samples, more than its {size} bytes can index")
        offsets = np.frombuffer(self._pread(4 * (count + 1), 4), "<u4").astype(np.int64)
        problem = _offsets(count, offsets, size)
        if problem:
            raise self._corrupt(f"{self._WHAT}'s {problem}")
        self._offsets = offsets.tolist()

    def _inflate(self, data: bytes) -> bytes:
        """The plain sample table of a compressed file's bytes ``data`` (whole-file compression)."""
        assert self.compression is not None
        return decompress(self.compression, data, self.path)

    def __len__(self) -> int:
        return max(0, len(self._offsets) - 1)

    def _decode(self, raw: memoryview, index: int) -> Any:
        """Sample ``index`` from its bytes ``raw`` (a view of writable memory of its own)."""
        raise NotImplementedError

    def _checked(self, raw: memoryview, index: int) -> Any:
        try:
            return self._decode(raw, index)
        except ReaderError as exc:
            if exc.path is not None:
                raise
            raise type(exc)(f"sample {index}: {exc.message}", path=self.path,
                            hint=None if isinstance(exc, RefusedContentError) else HINT_CORRUPT) from None
        except (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise self._corrupt(f"sample {index} does not decode ({type(exc).__name__}: {exc})") from None

    def _region(self, lo: int, hi: int) -> memoryview:
        """Bytes ``[lo, hi)`` of the (inflated) file, writable and the caller's: a copy-on-write view
        of a plain file's map, or a copy of the inflated bytes (which later reads share)."""
        if self._cow is not None:
            return self._cow.region(lo, hi - lo)
        return memoryview(self._pread(hi - lo, lo))

    def _get(self, index: int) -> Sample:
        return self._checked(self._region(self._offsets[index], self._offsets[index + 1]), index)

    def _iter_range(self, start: int, stop: int) -> Iterator[Sample]:
        base = self._offsets[start]
        run = self._region(base, self._offsets[stop])  # one view for the run
        for i in range(start, stop):
            yield self._checked(run[self._offsets[i] - base:self._offsets[i + 1] - base], i)
