"""The index and footer of a ``.dcz`` shard (layout: see :mod:`readers.zstd`): encoding, and the
validation of its tables before any declared size is used. Pure functions, thread-safe."""
from __future__ import annotations

import struct
import zlib
from array import array

import numpy as np

from .codec import Schema, schema_to_json

__all__ = ["MAGIC", "RAW_BLOCK", "FOOTER", "HEAD", "BLOCK_ROW", "SAMPLE_ROW", "encode_index", "encode_footer",
           "block_problem", "sample_problem"]

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
