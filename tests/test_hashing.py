"""Content hashes (``datacache.hashing``): every way of hashing a file gives the bytes' hash."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from datacache.hashing import hash_bytes, hash_fd, hash_file, hash_private_file


@pytest.mark.parametrize("size", [0, 1, 4096, (8 << 20) + 3])  # empty, tiny, a page, past a read chunk
def test_a_file_hashed_in_place_has_the_hash_of_its_bytes(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    want = hash_bytes(data)
    assert hash_private_file(path) == want == hash_file(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert hash_fd(fd) == want
    finally:
        os.close(fd)


def test_one_changed_byte_changes_the_hash(tmp_path: Path) -> None:
    data = bytearray(os.urandom(1 << 20))
    path = tmp_path / "f"
    path.write_bytes(data)
    before = hash_private_file(path)
    data[len(data) // 2] ^= 1
    path.write_bytes(data)
    after = hash_private_file(path)
    assert after != before and after == hash_bytes(bytes(data))
