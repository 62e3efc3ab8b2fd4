"""The index and footer of a ``.dcz`` shard (layout: see :mod:`readers.zstd`): encoding, and the
validation of its tables before any declared size is used. Pure functions, thread-safe."""
from __future__ import annotations

import struct
import zlib
from array import array
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .base import ShardLayout
from .codec import Schema, schema_from_json, schema_to_json
from .errors import HINT_CORRUPT, ReaderError

__all__ = ["MAGIC", "RAW_BLOCK", "FOOTER", "HEAD", "BLOCK_ROW", "SAMPLE_ROW", "encode_index", "encode_footer",
           "block_problem", "sample_problem", "DczIndex", "parse_index", "dcz_layout"]

MAGIC = b"DCZ1"
FOOTER = struct.Struct("<QQQI4s")
HEAD = struct.Struct("<IQQQ")
BLOCK_ROW, SAMPLE_ROW = 32, 16
RAW_BLOCK = 1 << 63  # flag in a block's file_offset: stored uncompressed


def encode_index(schema: Schema, dict_offset: int, dict_length: int,
                 blocks: array, samples: array) -> bytes:
    """Serialize the index (``blocks``/``samples`` are flat u64 arrays)."""
    schema_json = schema_to_json(schema).encode("utf-8")
    head = HEAD.pack(len(schema_json), dict_offset, dict_length, len(blocks) // 4)
    return b"".join((head, schema_json, _u64_bytes(blocks), _u64_bytes(samples)))


def _u64_bytes(values: array) -> bytes:
    return np.asarray(values, dtype="<u8").tobytes()


def encode_footer(index_offset: int, index: bytes, sample_count: int) -> bytes:
    return FOOTER.pack(index_offset, len(index), sample_count, zlib.crc32(index), MAGIC)


def block_problem(blocks: np.ndarray, n: int, index_offset: int, max_block_bytes: int) -> str | None:
    """What is wrong with a block table (rows: file_offset, compressed_len, raw_len, first_sample)."""
    if (len(blocks) == 0) != (n == 0):
        return f"{len(blocks)} blocks for {n} samples"
    if not len(blocks):
        return None
    off, clen, rlen, first = blocks.T
    raw = (off & np.uint64(RAW_BLOCK)) != 0
    off = off & np.uint64(RAW_BLOCK - 1)
    if (raw & (clen != rlen)).any():
        return "a raw block's stored and raw sizes differ"
    with np.errstate(over="ignore"):
        spans_ok = (off >= len(MAGIC)) & (clen >= 1) & (clen <= index_offset) & (off <= index_offset - clen)
    if not spans_ok.all():
        return "a block lies outside the data region"
    if ((rlen < 1) | (rlen > max_block_bytes)).any():
        return f"a block declares a raw size above max_block_bytes={max_block_bytes} (or zero)"
    if first[0] != 0 or (first >= n).any() or (np.diff(first.astype(np.int64)) <= 0).any():
        return "block sample ranges are not increasing"
    return None


def sample_problem(blocks: np.ndarray, samples: np.ndarray, n: int) -> str | None:
    """What is wrong with a sample table (rows: offset_in_block, length) given valid blocks."""
    if n == 0:
        return None
    counts = np.diff(np.append(blocks[:, 3], np.uint64(n)).astype(np.int64))
    raw = np.repeat(blocks[:, 2], counts)
    off, length = samples[:, 0], samples[:, 1]
    with np.errstate(over="ignore"):
        ok = (off <= raw) & (length <= raw - off)
    return None if ok.all() else f"sample {int(np.argmin(ok))} lies outside its block"


@dataclass(frozen=True)
class DczIndex:
    """A validated index: ``blocks`` rows (file_offset with the raw flag, compressed_len, raw_len,
    first_sample), ``samples`` rows (offset_in_block, length), the dictionary's span, and where the
    index starts."""

    schema: Schema
    blocks: np.ndarray
    samples: np.ndarray
    count: int
    dict_span: tuple[int, int]
    index_offset: int


def parse_index(read: Callable[[int, int], bytes], size: int, max_block_bytes: int, where: str) -> DczIndex:
    """Read (``read(start, end)``: those bytes of the file) and validate the footer and index of a
    dcz file of ``size`` bytes, every size checked before use; ``ReaderError`` naming ``where``."""
    def corrupt(what: str) -> ReaderError:
        return ReaderError(f"corrupt dcz shard: {what}", path=where, hint=HINT_CORRUPT)
    if size < len(MAGIC) + FOOTER.size:
        raise corrupt(f"only {size} bytes, too small for a footer")
    io, il, n, crc, magic = FOOTER.unpack(read(size - FOOTER.size, size))
    if magic != MAGIC:
        raise corrupt("no footer magic at the end of the file")
    if io < len(MAGIC) or il != size - FOOTER.size - io:
        raise corrupt(f"index span ({io}, {il}) does not fit the file")
    index = read(io, io + il)
    if zlib.crc32(index) != crc:
        raise corrupt("index checksum mismatch")
    if il < HEAD.size:
        raise corrupt("index too short")
    schema_len, dict_off, dict_len, nblocks = HEAD.unpack_from(index, 0)
    pos = HEAD.size + schema_len
    if pos > il or nblocks > (il - pos) // BLOCK_ROW:
        raise corrupt("index header declares more data than the index holds")
    schema = schema_from_json(index[HEAD.size:pos], where)
    if il - pos - nblocks * BLOCK_ROW != n * SAMPLE_ROW:
        raise corrupt(f"sample table does not match the sample count {n}")
    if dict_len and (dict_len > max_block_bytes or not len(MAGIC) <= dict_off <= io - dict_len):
        raise corrupt(f"dictionary span ({dict_off}, {dict_len}) is invalid")
    blocks = np.frombuffer(index, "<u8", nblocks * 4, pos).reshape(nblocks, 4)
    samples = np.frombuffer(index, "<u8", n * 2, pos + nblocks * BLOCK_ROW).reshape(n, 2)
    problem = block_problem(blocks, n, io, max_block_bytes) or sample_problem(blocks, samples, n)
    if problem:
        raise corrupt(problem)
    return DczIndex(schema, blocks, samples, n, (dict_off, dict_len), io)


def dcz_layout(read: Callable[[int, int], bytes], size: int, name: str) -> ShardLayout:
    """Where a dcz file's samples lie (``ShardLayout``): its units are its blocks; the magic, the
    dictionary, the index and the footer are the ranges every read needs."""
    ix = parse_index(read, size, 1 << 62, name)
    offsets = (ix.blocks[:, 0] & np.uint64(RAW_BLOCK - 1)).astype(np.int64)
    ends = offsets + ix.blocks[:, 1].astype(np.int64)
    d_off, d_len = ix.dict_span
    fixed = [(0, len(MAGIC))] + ([(d_off, d_off + d_len)] if d_len else []) + [(ix.index_offset, size)]
    return ShardLayout(size=size, samples=ix.count, fixed=tuple(fixed),
                       spans=tuple(zip(offsets.tolist(), ends.tolist())),
                       first=tuple(ix.blocks[:, 3].astype(np.int64).tolist()))
