"""LMDB shards: one LMDB environment *file* (``subdir=False``) per shard.

Writer: keys are 8-byte big-endian sample indices, values :func:`readers.codec.encode_sample`
bytes; the schema and sample count are stored as JSON under :data:`META_KEY` (it sorts after
every index key below 2**56 and is not a sample). The environment is built under a temporary
name without a lock file, its map size doubling on ``MapFullError``, then renamed into place.

Reader: opened ``readonly, lock=False, readahead=False``. Files written here give direct
``get(i)`` lookups. Any other LMDB file reads too: its keys are listed on open and samples come
back in key order as ``{"key": key_bytes, "value": value_bytes}``. The reader rejects files
shorter than their last used page (a truncated file would otherwise crash on access); LMDB does
not verify page contents, so only open LMDB files you or your dataset writer produced.

Thread safety: one reader or writer per thread.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Iterator

import lmdb  # absolute import: the py-lmdb library, not this module

from .base import ShardFormat, _remove
from .base import ShardReader as _BaseReader
from .base import ShardWriter as _BaseWriter
from .codec import Sample, Schema, decode_sample, encode_sample, schema_from_json
from .errors import HINT_CORRUPT, HINT_FORMAT, ReaderError

__all__ = ["LmdbShardReader", "LmdbShardWriter", "FORMAT", "META_KEY"]

META_KEY = b"__datacache_schema__"
_KEY = struct.Struct(">Q")
_FOREIGN_SCHEMA: Schema = {"key": "bytes", "value": "bytes"}


class LmdbShardWriter(_BaseWriter):
    """Write an LMDB shard file. ``map_size``: initial map size (doubles when full);
    ``commit_bytes``: payload bytes per write transaction."""

    def __init__(self, path: str | os.PathLike[str], schema: Schema, *,
                 map_size: int = 64 << 20, commit_bytes: int = 64 << 20) -> None:
        super().__init__(path, schema)
        _remove(self.tmp_path)
        self.commit_bytes = commit_bytes
        self._env = lmdb.open(self.tmp_path, subdir=False, map_size=map_size, lock=False,
                              readahead=False, meminit=False, max_dbs=0)
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0

    def _write(self, sample: Sample) -> int:
        value = encode_sample(sample, self.schema)
        self._pending.append((_KEY.pack(self.samples_written), value))
        self._pending_bytes += len(value)
        if self._pending_bytes >= self.commit_bytes:
            self._commit(self._pending)
        return len(value)

    def _commit(self, items: list[tuple[bytes, bytes]]) -> None:
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for key, value in items:
                        txn.put(key, value)
                break
            except lmdb.MapFullError:  # the transaction was aborted: grow and redo it
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
        self._pending, self._pending_bytes = [], 0

    def _finish(self) -> None:
        meta = {"version": 1, "schema": self.schema, "count": self.samples_written}
        self._commit(self._pending + [(META_KEY, json.dumps(meta).encode("utf-8"))])
        self._env.sync(True)
        self._env.close()
        _remove(self.tmp_path + "-lock")

    def _discard(self) -> None:
        self._env.close()
        _remove(self.tmp_path + "-lock")


class LmdbShardReader(_BaseReader):
    """Read an LMDB shard file (one long-lived read transaction per process).

    Not thread-safe: one reader per thread.
    """

    _HANDLE_ATTRS = ("_env", "_txn")

    def __init__(self, path: str | os.PathLike[str], *, max_readers: int = 126) -> None:
        super().__init__(path)
        self.max_readers = max_readers
        self._env: lmdb.Environment | None = None
        self._txn: lmdb.Transaction | None = None
        self._keys: list[bytes] | None = None  # foreign files only
        self._n = -1
        self._ensure_open()

    def _corrupt(self, what: str) -> ReaderError:
        return ReaderError(f"corrupt lmdb shard: {what}", path=self.path, hint=HINT_CORRUPT)

    def _open_handles(self) -> None:
        size = os.stat(self.path).st_size
        if os.path.isdir(self.path) or size == 0:
            raise ReaderError("not an lmdb shard (expected a non-empty LMDB data file)",
                              path=self.path, hint=HINT_FORMAT)
        try:
            self._env = lmdb.open(self.path, subdir=False, readonly=True, lock=False,
                                  readahead=False, max_readers=self.max_readers, create=False)
        except lmdb.Error as exc:
            detail = str(exc).replace(f"{self.path}: ", "")
            raise ReaderError(f"not an lmdb shard ({detail})", path=self.path,
                              hint=HINT_FORMAT) from None
        try:
            needed = (self._env.info()["last_pgno"] + 1) * self._env.stat()["psize"]
            if size < needed:
                raise self._corrupt(f"file has {size} bytes but its pages need {needed}")
            self._txn = self._env.begin(buffers=True)  # values are copied once, into writable memory
            if self._n < 0:
                self._load_layout()
        except lmdb.Error as exc:
            raise self._corrupt(f"cannot read the environment ({exc})") from None

    def _close_handles(self) -> None:
        if self._txn is not None:
            self._txn.abort()
        if self._env is not None:
            self._env.close()
        self._env = self._txn = None

    def _load_layout(self) -> None:
        assert self._txn is not None and self._env is not None
        entries = self._env.stat()["entries"]
        raw = self._txn.get(META_KEY)
        if raw is None:
            self._keys = [bytes(k) for k in self._txn.cursor().iternext(keys=True, values=False)]
            self.schema, self._n = dict(_FOREIGN_SCHEMA), len(self._keys)
            return
        try:
            meta = json.loads(bytes(raw))
            count, schema = meta["count"], meta["schema"]
        except (ValueError, TypeError, KeyError) as exc:
            raise self._corrupt(f"invalid metadata under {META_KEY!r} ({exc})") from None
        if isinstance(count, bool) or not isinstance(count, int) or count != entries - 1:
            raise self._corrupt(f"metadata declares {count!r} samples, the file holds "
                                f"{entries - 1}")
        self.schema = schema_from_json(json.dumps(schema), self.path)
        self._n = count

    def __len__(self) -> int:
        return self._n

    def _key(self, index: int) -> bytes:
        return self._keys[index] if self._keys is not None else _KEY.pack(index)

    def _sample(self, index: int, key: memoryview | bytes, value: memoryview | None) -> Sample:
        """Sample ``index`` from the buffers of the read transaction (valid only until it ends:
        copied here, into bytes or a ``bytearray`` the sample's arrays view writably)."""
        if value is None or key != self._key(index):
            raise self._corrupt(f"sample {index} (key {self._key(index)!r}) is missing")
        if self._keys is not None:
            return {"key": bytes(key), "value": bytes(value)}
        try:
            return decode_sample(bytearray(value), self.schema or {})
        except ReaderError as exc:
            raise self._corrupt(f"sample {index}: {exc}") from None

    def _get(self, index: int) -> Sample:
        assert self._txn is not None
        key = self._key(index)
        try:
            value = self._txn.get(key)
        except lmdb.Error as exc:
            raise self._corrupt(f"sample {index} cannot be read ({exc})") from None
        return self._sample(index, key, value)

    def _iter_range(self, start: int, stop: int) -> Iterator[Sample]:
        assert self._txn is not None
        i = start
        try:
            cursor = self._txn.cursor()
            found = cursor.set_key(self._key(start))
            for i in range(start, stop):
                key, value = cursor.item() if found else (b"", None)
                yield self._sample(i, key, value)
                found = cursor.next()
        except lmdb.Error as exc:
            raise self._corrupt(f"sample {i} cannot be read ({exc})") from None


def _check_import() -> Any:
    """The ``lmdb`` name above must be the library (guards against a shadowing sys.path)."""
    if not hasattr(lmdb, "open") or not hasattr(lmdb, "MapFullError"):
        raise ImportError(f"'import lmdb' found {lmdb!r}, not the py-lmdb library")
    return lmdb


_check_import()

FORMAT = ShardFormat(name="lmdb", extension=".lmdb", reader=LmdbShardReader,
                     ShardWriter=LmdbShardWriter)
