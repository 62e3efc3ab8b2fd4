"""Crafted shard files for the reader and hostile-input tests: ``.dcz`` files assembled block by
block (``craft_dcz``) and zstd bombs (``bomb_frame``)."""
from __future__ import annotations

import struct
from array import array
from typing import Any

import zstandard

from datacache.readers import zstd as rzstd

__all__ = ["craft_dcz", "bomb_frame"]


def craft_dcz(path: Any, blocks: list[tuple[bytes, int, list[tuple[int, int]]]],
              schema: dict[str, str] | None = None, sample_count: int | None = None) -> str:
    """Assemble a .dcz file from (frame, declared raw length, [(offset, length)]) blocks."""
    body, block_table, sample_table, first = bytearray(rzstd.MAGIC), array("Q"), array("Q"), 0
    for frame, raw_len, entries in blocks:
        block_table.extend((len(body), len(frame), raw_len, first))
        body += frame
        for offset, length in entries:
            sample_table.extend((offset, length))
            first += 1
    index = rzstd._encode_index(schema or {"x": "bytes"}, 0, 0, block_table, sample_table)
    count = len(sample_table) // 2 if sample_count is None else sample_count
    path.write_bytes(bytes(body) + index + rzstd._encode_footer(len(body), index, count))
    return str(path)


def bomb_frame(size: int, declared: int | None) -> bytes:
    """A zstd frame of ``size`` zero bytes whose header claims ``declared`` bytes (or no size)."""
    cobj = zstandard.ZstdCompressor(level=1, write_content_size=declared is not None) \
        .compressobj(size=size if declared is not None else -1)
    chunk = bytes(4 << 20)
    frame = b"".join([cobj.compress(chunk) for _ in range(size // len(chunk))] + [cobj.flush()])
    if declared is None:
        return frame
    fhd = frame[4]
    assert fhd >> 6 == 2  # 4-byte frame content size field
    pos = 5 + (0 if fhd & 0x20 else 1) + [0, 1, 2, 4][fhd & 3]
    frame = frame[:pos] + struct.pack("<I", declared) + frame[pos + 4:]
    assert zstandard.frame_content_size(frame) == declared
    return frame
