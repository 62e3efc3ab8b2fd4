"""The node-wide cache index: an LMDB environment shared by every process using one cache.

It records, per key, the entry's size, hash, last access and which tiers hold a file for it (with
the verification token under which that file was last verified); per tier, the bytes used; and
node-wide counters. LMDB write transactions are serialized across processes by LMDB itself and
are kept short: no network or bulk file I/O ever happens inside one.

The environment is opened lazily per process and re-opened after ``fork`` (an LMDB environment
must not be used across a fork). ``Index`` is thread-safe.
"""
from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lmdb

__all__ = ["Entry", "Index", "COUNTERS"]

COUNTERS = (
    "hits_ram", "hits_ssd", "misses", "bytes_ram", "bytes_ssd", "remote_bytes", "fetches", "fetch_seconds",
    "evictions_ram", "evictions_ssd", "demotions", "promotions", "bypassed", "corrupt", "waited",
)
_D = struct.Struct("<d")


@dataclass
class Entry:
    """What the index knows of one key. ``tiers`` maps tier name -> {"file": name, "token": str}."""

    size: int
    hash: str
    atime: float
    tiers: dict[str, dict[str, str]] = field(default_factory=dict)

    def dumps(self) -> bytes:
        return json.dumps([self.size, self.hash, self.atime, self.tiers], separators=(",", ":")).encode()

    @classmethod
    def loads(cls, raw: bytes) -> "Entry":
        size, digest, atime, tiers = json.loads(raw)
        return cls(size, digest, atime, tiers)


class Index:
    """LMDB-backed index at ``<control dir>/index.lmdb``."""

    def __init__(self, control_dir: str, map_size: int = 1 << 30) -> None:
        self.path = os.path.join(control_dir, "index.lmdb")
        self._map_size = map_size
        self._env: Any = None
        self._pid = -1
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}

    @property
    def env(self) -> Any:
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    if self._env is not None:
                        # Inherited across fork: close our copy (LMDB only clears reader slots of
                        # this pid, and fcntl locks are not inherited), then open afresh.
                        self._env.close()
                    self._env = lmdb.open(self.path, subdir=False, max_dbs=4, map_size=self._map_size,
                                          max_readers=2048, sync=False, metasync=False, readahead=False)
                    self._dbs = {n: self._env.open_db(n.encode()) for n in ("entries", "meta", "stats")}
                    self._pending = {}
                    self._pid = os.getpid()
        return self._env

    @contextmanager
    def read(self) -> Iterator["Txn"]:
        with self.env.begin(write=False, buffers=False) as txn:
            yield Txn(txn, self._dbs)

    @contextmanager
    def write(self) -> Iterator["Txn"]:
        """A write transaction; per-process counter deltas are flushed into it."""
        with self.env.begin(write=True) as txn:
            t = Txn(txn, self._dbs)
            yield t
            with self._lock:
                pending, self._pending = self._pending, {}
            t.add_counters(pending)

    def count(self, **deltas: float) -> None:
        """Add to node-wide counters at the next write transaction (cheap, no I/O)."""
        with self._lock:
            for k, v in deltas.items():
                self._pending[k] = self._pending.get(k, 0.0) + v

    def flush(self) -> None:
        """Write pending counter deltas now."""
        with self.write():
            pass

    def close(self) -> None:
        with self._lock:
            if self._env is not None and self._pid == os.getpid():
                self._env.close()
            self._env = None
            self._pid = -1


class Txn:
    """A thin typed view over one LMDB transaction (not thread-safe: one per thread)."""

    def __init__(self, txn: Any, dbs: dict[str, Any]) -> None:
        self.txn = txn
        self.dbs = dbs

    def get(self, key: str) -> Entry | None:
        raw = self.txn.get(key.encode(), db=self.dbs["entries"])
        return None if raw is None else Entry.loads(raw)

    def put(self, key: str, entry: Entry) -> None:
        if entry.tiers:
            self.txn.put(key.encode(), entry.dumps(), db=self.dbs["entries"])
        else:
            self.txn.delete(key.encode(), db=self.dbs["entries"])

    def delete(self, key: str) -> None:
        self.txn.delete(key.encode(), db=self.dbs["entries"])

    def items(self) -> Iterator[tuple[str, Entry]]:
        with self.txn.cursor(db=self.dbs["entries"]) as cur:
            for k, v in cur:
                yield bytes(k).decode(), Entry.loads(bytes(v))

    def meta(self, name: str, default: str | None = None) -> str | None:
        raw = self.txn.get(name.encode(), db=self.dbs["meta"])
        return default if raw is None else bytes(raw).decode()

    def set_meta(self, name: str, value: str) -> None:
        self.txn.put(name.encode(), value.encode(), db=self.dbs["meta"])

    def used(self, tier: str) -> int:
        return int(self.meta(f"used/{tier}", "0") or 0)

    def add_used(self, tier: str, delta: int) -> None:
        self.set_meta(f"used/{tier}", str(self.used(tier) + delta))

    def add_counters(self, deltas: dict[str, float]) -> None:
        db = self.dbs["stats"]
        for name, delta in deltas.items():
            if delta:
                raw = self.txn.get(name.encode(), db=db)
                old = _D.unpack(raw)[0] if raw else 0.0
                self.txn.put(name.encode(), _D.pack(old + delta), db=db)

    def counters(self) -> dict[str, float]:
        out = {name: 0.0 for name in COUNTERS}
        with self.txn.cursor(db=self.dbs["stats"]) as cur:
            for k, v in cur:
                out[bytes(k).decode()] = _D.unpack(bytes(v))[0]
        return out

    def reset_counters(self) -> None:
        self.txn.drop(self.dbs["stats"], delete=False)
