"""The native ``.dcz`` shard format: samples packed into zstd-compressed blocks plus an index.

Layout (integers little-endian)::

    b"DCZ1"                                   magic
    [dictionary]                              optional zstd dictionary (raw bytes)
    block 0 .. block B-1                      one zstd frame each (content size + checksum), or the
                                              raw bytes where zstd would not shrink them (flagged)
    index:  u32 schema_len, u64 dict_offset, u64 dict_length, u64 block_count,
            schema JSON, B x (u64 file_offset, u64 compressed_len, u64 raw_len, u64 first_sample),
            N x (u64 offset_in_block, u64 length)
    footer: u64 index_offset, u64 index_length, u64 sample_count, u32 crc32(index), b"DCZ1"

Each block holds the :func:`readers.codec.encode_sample` bytes of consecutive samples (about
``block_bytes`` raw; a larger sample gets a block of its own), so ``get(i)`` decompresses one
block. A block that zstd shrinks by less than ``min_saving`` (default 1/8: already-compressed
images, audio, random bytes, and arrays of such values, whose only redundancy is the samples'
own headers) is stored raw, flagged by the top bit of its ``file_offset`` (``RAW_BLOCK``, with compressed_len ==
raw_len): its samples are read in place, zero-copy views of the file mapped copy-on-write
(``readers._cowmap``: writable, and a write never reaches the file). Compressed blocks are
decompressed into pooled, reused buffers (``readers._bufpool``). Every declared size is validated
against the file size and ``max_block_bytes`` before use, and a block is decompressed into a
buffer of exactly its validated raw length, so a crafted file (or a zstd bomb) raises
:class:`ReaderError` instead of allocating unbounded memory.

Columnar reads (:meth:`ZstdShardReader.columns`): the rows of a run as a :class:`readers.columns.Columns`
table, parsed vectorised over all their blocks at once (raw blocks read in the mapping itself, never
handed out, so they need no private copy); a compressed block is decompressed once per
:class:`BlockCache` that the caller passes, however many runs read rows of it.

Thread safety: one reader or writer per thread; a :class:`BlockCache` is thread-safe.
"""
from __future__ import annotations

import collections
import mmap
import os
import threading
from array import array
from typing import Any, Iterator, Literal

import numpy as np
import zstandard

from ._bufpool import shared_pool
from ._cowmap import CowMap
from ._dczindex import FOOTER as _FOOTER
from ._dczindex import MAGIC, RAW_BLOCK, dcz_layout, parse_index
from ._dczindex import encode_footer as _encode_footer
from ._dczindex import encode_index as _encode_index
from .base import ShardFormat
from .base import ShardReader as _BaseReader
from .base import ShardWriter as _BaseWriter
from .codec import Sample, Schema, decode_sample, decode_uniform, encode_sample, owned
from .columns import Columns, RowLayouts, address_of, is_sorted, parse_at, parse_rows
from .errors import HINT_CORRUPT, HINT_FORMAT, ReaderError

__all__ = ["ZstdShardReader", "ZstdShardWriter", "BlockCache", "FORMAT", "MAGIC", "DEFAULT_BLOCK_BYTES",
           "DEFAULT_MAX_BLOCK_BYTES", "DEFAULT_MIN_SAVING", "RAW_BLOCK"]

DEFAULT_BLOCK_BYTES = 1 << 20
DEFAULT_MAX_BLOCK_BYTES = 1 << 30
DEFAULT_MIN_SAVING = 1 / 8  # a block zstd shrinks by less is stored raw (``ZstdShardWriter``)


class ZstdShardWriter(_BaseWriter):
    """Write a ``.dcz`` shard.

    ``block_bytes``: target raw bytes per block. ``level``: zstd level. ``dictionary``: a
    :class:`zstandard.ZstdCompressionDict` to compress with (stored in the file), or
    ``train_dictionary=True`` to train one of ``dict_size`` bytes on the first
    ``dict_train_samples`` samples (or the first ``128 * dict_size`` bytes, whichever comes
    first; if training fails, e.g. too little data, no dictionary is used). ``min_saving``: a
    block that zstd shrinks by less than this share of its bytes is stored raw, read in place
    (zero-copy) rather than decompressed by every read of it; 0 keeps every block zstd shrinks.
    """

    def __init__(self, path: str | os.PathLike[str], schema: Schema, *,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, level: int = 3,
                 dictionary: zstandard.ZstdCompressionDict | None = None,
                 train_dictionary: bool = False, dict_train_samples: int = 1024,
                 dict_size: int = 64 * 1024, min_saving: float = DEFAULT_MIN_SAVING,
                 max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES) -> None:
        super().__init__(path, schema)
        if not 0 <= min_saving < 1:
            raise ValueError(f"min_saving must be in [0, 1), got {min_saving}")
        self.min_saving = min_saving
        if not 1 <= block_bytes <= max_block_bytes:
            raise ValueError(f"block_bytes must be in [1, {max_block_bytes}], got {block_bytes}")
        if dictionary is not None and train_dictionary:
            raise ValueError("pass either dictionary= or train_dictionary=True, not both")
        self.block_bytes, self.level, self.max_block_bytes = block_bytes, level, max_block_bytes
        self._dict_train_samples, self._dict_size = dict_train_samples, dict_size
        self._file = open(self.tmp_path, "wb")
        self._file.write(MAGIC)
        self._cctx: zstandard.ZstdCompressor | None = None
        self._dict_span = (0, 0)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._block: list[bytes] = []
        self._block_size = 0
        self._block_first = 0
        self._blocks: array = array("Q")
        self._samples: array = array("Q")
        if not train_dictionary:
            self._start(dictionary)

    def _start(self, dictionary: zstandard.ZstdCompressionDict | None) -> None:
        if dictionary is not None:
            data = dictionary.as_bytes()
            self._dict_span = (self._file.tell(), len(data))
            self._file.write(data)
        self._cctx = zstandard.ZstdCompressor(level=self.level, dict_data=dictionary,
                                              write_checksum=True, write_content_size=True)

    def _train(self) -> None:
        dictionary = None
        try:
            dictionary = zstandard.train_dictionary(self._dict_size, self._pending)
        except zstandard.ZstdError:  # too few / too small samples: compress without one
            pass
        self._start(dictionary)
        pending, self._pending = self._pending, []
        for data in pending:
            self._add(data)

    def _write(self, sample: Sample) -> int:
        data = encode_sample(sample, self.schema)
        if len(data) > self.max_block_bytes:
            raise ValueError(f"{self.path}: sample of {len(data)} bytes exceeds "
                             f"max_block_bytes={self.max_block_bytes}")
        if self._cctx is None:
            self._pending.append(data)
            self._pending_bytes += len(data)
            if len(self._pending) >= self._dict_train_samples \
                    or self._pending_bytes >= 128 * self._dict_size:
                self._train()
        else:
            self._add(data)
        return len(data)

    def _add(self, data: bytes) -> None:
        if self._block and self._block_size + len(data) > self.block_bytes:
            self._flush()
        self._samples.extend((self._block_size, len(data)))
        self._block.append(data)
        self._block_size += len(data)
        if self._block_size >= self.block_bytes:
            self._flush()

    def _flush(self) -> None:
        assert self._cctx is not None
        raw = b"".join(self._block)
        frame = self._cctx.compress(raw)
        if len(frame) < len(raw) and len(raw) - len(frame) >= self.min_saving * len(raw):  # worth decompressing
            self._blocks.extend((self._file.tell(), len(frame), len(raw), self._block_first))
            self._file.write(frame)
        else:  # incompressible: stored raw, read in place
            self._blocks.extend((self._file.tell() | RAW_BLOCK, len(raw), len(raw), self._block_first))
            self._file.write(raw)
        self._block_first += len(self._block)
        self._block, self._block_size = [], 0

    @property
    def unit_rows(self) -> tuple[int, ...]:
        """Samples per block, the last block (the shard's end cuts it short) not counted."""
        firsts = self._blocks[3::4].tolist() + [self._block_first]
        return tuple(b - a for a, b in zip(firsts[:-2], firsts[1:-1]))

    def _finish(self) -> None:
        if self._cctx is None:
            self._train()
        if self._block:
            self._flush()
        index = _encode_index(self.schema, *self._dict_span, self._blocks, self._samples)
        offset = self._file.tell()
        self._file.write(index)
        self._file.write(_encode_footer(offset, index, len(self._samples) // 2))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def _discard(self) -> None:
        self._file.close()


class ZstdShardReader(_BaseReader):
    """Read a ``.dcz`` shard through ``mmap``; keeps the last decompressed block.

    ``max_block_bytes`` caps the raw size a block may declare (default 1 GiB).
    Not thread-safe: one reader per thread.
    """

    _HANDLE_ATTRS = ("_file", "_mmap", "_cow", "_dctx")

    def __init__(self, path: str | os.PathLike[str], *,
                 max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES) -> None:
        super().__init__(path)
        self.max_block_bytes = max_block_bytes
        self._file: Any = None
        self._mmap: mmap.mmap | None = None
        self._cow: CowMap | None = None
        self._dctx: zstandard.ZstdDecompressor | None = None
        self._size = -1
        self._dict_bytes: bytes | None = None
        self._cached: tuple[int, memoryview] = (-1, memoryview(b""))
        self._layouts: RowLayouts | None = None  # the rows ``columns`` parsed
        self._whole: Columns | bool | None = None  # every row's table where all blocks are raw (_whole_table)
        self._read_before = False  # columns() called before, or prepare_tables(): a reader kept across runs
        self._ensure_open()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_cached"] = None  # a view of this process's pooled buffer
        state["_layouts"] = None  # parsed again where needed
        state["_whole"] = None  # addresses in this process's mapping
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["_cached"] = (-1, memoryview(b""))
        self.__dict__.update(state)

    def _corrupt(self, what: str) -> ReaderError:
        return ReaderError(f"corrupt dcz shard: {what}", path=self.path, hint=HINT_CORRUPT)

    def _open_handles(self) -> None:
        self._file = open(self.path, "rb")
        size = os.fstat(self._file.fileno()).st_size
        if self._size >= 0 and size != self._size:
            raise self._corrupt(f"file size changed from {self._size} to {size} bytes")
        head = os.pread(self._file.fileno(), len(MAGIC), 0)
        if head != MAGIC:
            raise ReaderError(f"not a dcz shard (bad magic {head[:4]!r} at offset 0, expected "
                              f"{MAGIC!r})", path=self.path, hint=HINT_FORMAT)
        if size < len(MAGIC) + _FOOTER.size:
            raise self._corrupt(f"only {size} bytes, too small for a footer")
        st = os.fstat(self._file.fileno())
        self._ident = (self.path, st.st_dev, st.st_ino, size, st.st_mtime_ns)  # BlockCache keys
        self._cow = CowMap(self._file.fileno(), size)  # copy-on-write: samples are writable
        self._mmap = self._cow.map
        if self._size < 0:
            self._parse(size)
            self._size = size
        try:
            self._dctx = zstandard.ZstdDecompressor(
                dict_data=None if self._dict_bytes is None
                else zstandard.ZstdCompressionDict(self._dict_bytes))
        except zstandard.ZstdError as exc:
            raise self._corrupt(f"invalid zstd dictionary ({exc})") from None

    def _close_handles(self) -> None:
        self._cached = (-1, memoryview(b""))
        self._whole = None  # its addresses are the mapping's
        if self._cow is not None:
            self._cow.close()  # samples of raw blocks still view it: unmapped when they are gone
        if self._file is not None:
            self._file.close()
        self._file = self._mmap = self._cow = self._dctx = None
        self._cached = (-1, memoryview(b""))

    def _parse(self, size: int) -> None:
        """Read and validate footer and index (all sizes checked before use)."""
        assert self._mmap is not None
        mm = self._mmap
        ix = parse_index(lambda a, b: mm[a:b], size, self.max_block_bytes, os.fspath(self.path))
        self.schema = ix.schema
        offset, length = ix.dict_span
        if length:
            self._dict_bytes = mm[offset:offset + length]
        self._blocks, self._samples, self._n = ix.blocks, ix.samples, ix.count
        self._first = ix.blocks[:, 3]

    def __len__(self) -> int:
        return self._n

    @property
    def inflation(self) -> float:
        """Bytes of memory that reading every sample decompresses, per byte of this shard's blocks
        in the file: 0 where every block is raw (read in place from the mapped file), about the
        compression ratio where every block is compressed."""
        packed = (self._blocks[:, 0] & np.uint64(RAW_BLOCK)) == 0
        stored = float(self._blocks[:, 1].astype(np.float64).sum())
        return float(self._blocks[packed, 2].astype(np.float64).sum()) / stored if stored else 0.0

    def _block_of(self, index: int) -> int:
        return int(np.searchsorted(self._first, index, side="right")) - 1

    def _block_end(self, block: int) -> int:
        return int(self._first[block + 1]) if block + 1 < len(self._first) else self._n

    def _block(self, block: int) -> memoryview:
        """Block ``block`` decompressed into a pooled buffer (see ``readers._bufpool``)."""
        if self._cached[0] == block:
            return self._cached[1]
        off, clen, rlen = (int(v) for v in self._blocks[block, :3])
        assert self._mmap is not None and self._dctx is not None
        if off & RAW_BLOCK:  # zero-copy: the samples are writable views of the mapped file
            assert self._cow is not None
            self._cached = (-1, memoryview(b""))  # drop our view before the map checks for live ones
            view = self._cow.region(off & (RAW_BLOCK - 1), rlen)
            self._cached = (block, view)
            return view
        with memoryview(self._mmap) as whole:
            frame = whole[off:off + clen]
            try:
                declared = zstandard.frame_content_size(frame)
                if declared != rlen:  # also rejects "unknown size" (-1) frames
                    raise self._corrupt(f"block {block} frame declares {declared} bytes, the index "
                                        f"{rlen}")
                out = shared_pool().take(rlen)
                got, more = self._decompress_into(frame, out)
            except zstandard.ZstdError as exc:
                raise self._corrupt(f"block {block} does not decompress ({exc})") from None
            finally:
                frame.release()
        if got != rlen or more:
            raise self._corrupt(f"block {block} decompresses to {'more than' if more else got} bytes, "
                                f"not {rlen}")
        self._cached = (block, out)
        return out

    def _decompress_into(self, frame: memoryview, out: memoryview) -> tuple[int, bool]:
        """Decompress one frame into ``out``: (bytes written, whether the frame holds more)."""
        assert self._dctx is not None
        with self._dctx.stream_reader(frame, read_size=len(frame), read_across_frames=False,
                                      closefd=False) as src:
            got = 0
            while got < len(out):
                n = src.readinto(out[got:])
                if not n:
                    break
                got += n
            return got, bool(src.read(1))

    def _decode(self, data: memoryview, offset: int, length: int, index: int) -> Sample:
        try:
            return decode_sample(data[offset:offset + length], self.schema or {})
        except ReaderError as exc:
            raise self._corrupt(f"sample {index}: {exc}") from None

    def _get(self, index: int) -> Sample:
        block = self._block_of(index)
        offset, length = (int(v) for v in self._samples[index])
        return self._decode(memoryview(self._block(block)), offset, length, index)

    def _get_many(self, indices: list[int], copy: bool) -> list[Sample]:
        """Sorted ``indices``: the block of each found at once, each block decoded once, and a
        block's several samples at once where their span is uniform (``_uniform``; with ``copy``
        their bytes copied once for them all). A raw block's samples are never copied: they are
        views of the file's mapping (``CowMap``), which no later read changes or unmaps, and which
        costs no memory of this process's own, unlike a decompressed block's pooled buffer."""
        out: list[Sample] = []
        if not indices:
            return out
        blocks = np.searchsorted(self._first, indices, side="right") - 1
        cuts = np.flatnonzero(np.diff(blocks)) + 1
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(indices)]):
            block = int(blocks[lo])
            data = memoryview(self._block(block))
            own = copy and not int(self._blocks[block, 0]) & RAW_BLOCK
            first, last = indices[lo], indices[hi - 1]
            fast = self._uniform(data, self._samples[first:last + 1], [i - first for i in indices[lo:hi]], own) \
                if hi - lo > 1 else None
            if fast is not None:
                out += fast
                continue
            for index, (offset, length) in zip(indices[lo:hi], self._samples[indices[lo:hi]].tolist()):
                sample = self._decode(data, offset, length, index)
                out.append(owned(sample) if own else sample)
        return out

    def _iter_range(self, start: int, stop: int) -> Iterator[Sample]:
        self._cached = (-1, memoryview(b""))  # a new run decodes afresh: no earlier in-place write shows
        block, i = self._block_of(start), start
        while i < stop:
            data = memoryview(self._block(block))
            end = min(stop, self._block_end(block))
            rows = self._samples[i:end]
            fast = self._uniform(data, rows)
            if fast is not None:
                yield from fast
            else:
                for j, (offset, length) in enumerate(rows.tolist(), i):
                    yield self._decode(data, offset, length, j)
            i, block = end, block + 1

    def _uniform(self, data: memoryview, rows: np.ndarray, pick: list[int] | None = None,
                 copy: bool = False) -> list[Sample] | None:
        """The samples of ``rows`` (consecutive, in one block; ``pick``: only those at these
        positions of ``rows``; ``copy``: in memory of their own) decoded at once, if they are
        equal-sized with identical layouts (see :func:`readers.codec.decode_uniform`)."""
        if len(rows) < 2 or not (rows[:, 1] == rows[0, 1]).all():
            return None
        offset, length = int(rows[0, 0]), int(rows[0, 1])
        if not (rows[:, 0] == offset + length * np.arange(len(rows), dtype=np.uint64)).all():
            return None
        try:
            return decode_uniform(data, offset, length, len(rows), self.schema or {}, pick, copy)
        except ReaderError:
            return None  # sample by sample, for the error naming the sample

    def columns(self, lo: int, hi: int, rows: np.ndarray | None = None,
                blocks: BlockCache | None = None) -> Columns | None:
        """Samples ``lo .. hi - 1`` (or only ``rows``, sorted, within them) as one
        :class:`readers.columns.Columns` table, or None where they are not regular enough for
        one (see ``readers.columns``): read them one by one then, which raises what is wrong.
        ``blocks``: keeps the compressed blocks decompressed here for later calls."""
        n = len(self)
        if not 0 <= lo <= hi <= n:
            raise IndexError(f"{self.path}: range [{lo}, {hi}) outside [0, {n}]")
        idx = np.arange(lo, hi, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
        if len(idx) and (int(idx[0]) < lo or int(idx[-1]) >= hi or not is_sorted(idx)):
            raise IndexError(f"{self.path}: rows not sorted within [{lo}, {hi})")
        self._ensure_open()
        assert self._cow is not None and self._mmap is not None
        if not len(idx):
            return parse_rows(np.zeros(0, np.uint8), 0, idx, idx, self.schema or {})
        whole = self._whole_table(n)
        if whole is not None:
            return whole.take(idx)
        return self._table(idx, blocks)

    def prepare_tables(self) -> None:
        """Make the whole-shard table (``_whole_table``) now if it can be made, rather than at the
        second ``columns`` call: a reader kept across reads, for a caller that will read it as tables
        (``datacache.read.open_readers`` as it hands the reader out again, and
        ``datacache.read.shard_source`` as a read checks it back in). So a shard first read sample by sample
        (a cold epoch's part mix, behind the link) has its table before the first columnar epoch,
        whose runs then take their rows from it. Tried again at each call until made (a view of a
        sample handed out and alive that wrote into the file's pages stops it)."""
        if self._whole is not None:
            return
        self._ensure_open()
        self._read_before = True
        self._whole_table(self._n)

    def _whole_table(self, n: int) -> Columns | None:
        """Every row's table, made at the reader's second call (a reader kept across runs and epochs;
        or earlier, ``prepare_tables``) and kept while the mapping is open, where every block is raw
        (each row's bytes are then at a fixed address of the mapping; ``_make_whole``). Given only
        while no region handed out may have been written (``CowMap.clean``): a warm epoch's runs
        are then rows taken from it, with no parse and no per-block work. None where that does not
        hold (then read as asked)."""
        assert self._cow is not None
        if self._whole is False:
            return None
        if self._cached[0] >= 0:  # the reader's own view of its current raw block would count as handed out
            self._cached = (-1, memoryview(b""))
        if self._whole is None and not self._read_before:  # a reader read once (a partial copy's) makes none
            self._read_before = True
            return None
        if self._whole is None:
            self._whole = self._make_whole(n)
        whole = self._whole
        return whole if isinstance(whole, Columns) and self._cow.clean() else None

    def _make_whole(self, n: int) -> Columns | Literal[False] | None:
        """The whole-shard table, False where none can be made (a block not raw, or a row the
        table cannot hold), None where not now: a view handed out and alive wrote one of its pages,
        before or during the parse (``CowMap.unwritten``). Views alive that wrote nothing do not
        stop it (a cold epoch's kept rows), so the parse (and its page faults) happens while they
        live; the table is used only once none is alive (``clean``), when the written pages, if
        any, read as in the file again."""
        assert self._cow is not None
        raw = (self._blocks[:, 0] & np.uint64(RAW_BLOCK)) != 0
        if not (raw.all() and n):
            return False
        if not self._cow.unwritten():
            return None
        try:
            table = self._raw_rows(n)
        except ReaderError:  # a bad row: only the runs that read it fail, as without the whole table
            table = None
        if not self._cow.unwritten():
            return None
        return table if table is not None else False

    def _raw_rows(self, n: int) -> Columns | None:
        """The table of rows ``0 .. n - 1``, every block raw, at their addresses in the mapping
        (``_whole_table`` uses it only while no live view wrote a page: ``CowMap.clean``), parsed
        as ``_table`` parses (``readers.columns.parse_at``), with no per-block work."""
        assert self._mmap is not None
        whole = np.frombuffer(self._mmap, np.uint8)  # kept: the mapping stays while the table does
        starts = (self._blocks[:, 0] & np.uint64(RAW_BLOCK - 1)).astype(np.int64) + int(whole.ctypes.data)
        per_block = np.diff(np.append(self._first, n).astype(np.int64))
        at = np.repeat(starts, per_block) + self._samples[:n, 0].astype(np.int64)
        table = parse_at(at, self._samples[:n, 1].astype(np.int64), self.schema or {})
        if table is not None:
            table.keep = [whole]
        return table

    def _table(self, idx: np.ndarray, blocks: BlockCache | None) -> Columns | None:
        """The table of rows ``idx`` (sorted, not empty), block by block (see ``columns``)."""
        assert self._cow is not None and self._mmap is not None
        blk = np.searchsorted(self._first, idx, side="right") - 1
        starts = np.flatnonzero(np.diff(blk, prepend=-1))
        ublocks = blk[starts]
        info = self._blocks[ublocks]
        raw = (info[:, 0] & np.uint64(RAW_BLOCK)) != 0
        base = np.empty(len(ublocks), np.int64)
        keep: list[Any] = []
        if raw.any():
            self._cached = (-1, memoryview(b""))  # its region, if raw, is reclaimed now (not read again)
            whole = np.frombuffer(self._mmap, np.uint8)  # kept: the mapping stays while the table does
            keep.append(whole)
            offs = (info[raw, 0] & np.uint64(RAW_BLOCK - 1)).astype(np.int64)
            base[raw] = int(whole.ctypes.data) + offs
            for i in np.flatnonzero(raw)[self._cow.handed_out(offs, info[raw, 2].astype(np.int64))].tolist():
                view = self._cow.read_view(int(info[i, 0] & np.uint64(RAW_BLOCK - 1)), int(info[i, 2]))
                keep.append(view)  # a region a live view holds (and may have written): as in the file
                base[i] = address_of(view)
        for i in np.flatnonzero(~raw).tolist():
            buf = self._decompressed(int(ublocks[i]), blocks)
            keep.append(buf)
            base[i] = address_of(buf)
        at = np.repeat(base, np.diff(np.append(starts, len(idx)))) + self._samples[idx, 0].astype(np.int64)
        length = self._samples[idx, 1].astype(np.int64)
        if self._layouts is None:
            self._layouts = RowLayouts(self._n, self.schema or {})
        table = self._layouts.table(idx, at, length)
        if table is not None:
            table.keep = keep
        return table

    def _decompressed(self, block: int, blocks: BlockCache | None) -> memoryview:
        """Compressed block ``block``, from ``blocks`` or decompressed (and put there)."""
        if blocks is None:
            return self._block(block)
        key = (self._ident, block)
        buf = blocks.get(key)
        if buf is None:
            buf = self._block(block)
            blocks.put(key, buf)
        return buf


class BlockCache:
    """Decompressed blocks (``ZstdShardReader.columns``) kept up to ``budget`` bytes, the least
    recently used dropped first; keyed by the file's identity and the block. A dropped buffer goes
    back to its pool when nothing else refers to it. Thread-safe."""

    def __init__(self, budget: int) -> None:
        self.budget, self.nbytes = budget, 0
        self.hits = self.misses = 0
        self._blocks: collections.OrderedDict[Any, memoryview] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> memoryview | None:
        with self._lock:
            buf = self._blocks.get(key)
            if buf is None:
                self.misses += 1
                return None
            self.hits += 1
            self._blocks.move_to_end(key)
            return buf

    def put(self, key: Any, buf: memoryview) -> None:
        with self._lock:
            if key in self._blocks or len(buf) > self.budget:
                return
            self._blocks[key] = buf
            self.nbytes += len(buf)
            while self.nbytes > self.budget:
                _, old = self._blocks.popitem(last=False)
                self.nbytes -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.nbytes = 0


FORMAT = ShardFormat(name="zstd", extension=".dcz", reader=ZstdShardReader,
                     ShardWriter=ZstdShardWriter, layout=dcz_layout)
