"""The node-wide cache index: an LMDB environment shared by every process using one cache.

It records, per key, the entry's size, hash, last access and which tiers hold a file for it (with
the verification token under which that file was last verified); per tier, the bytes used; and
node-wide counters. LMDB write transactions are serialized across processes by LMDB itself and
are kept short: no network or bulk file I/O ever happens inside one.

The environment is opened lazily, once per process and path, and re-opened after ``fork`` (an
LMDB environment must not be used across a fork: ``fork`` waits for the transactions in flight and
the parent closes its environments first, see below). ``Index`` is thread-safe.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lmdb

from ..errors import CacheError

__all__ = ["Entry", "Index", "COUNTERS"]

COUNTERS = (
    "hits_ram", "hits_ssd", "misses", "bytes_ram", "bytes_ssd", "remote_bytes", "fetches", "fetch_seconds",
    "evictions_ram", "evictions_ssd", "demotions", "promotions", "bypassed", "corrupt", "waited",
    "partial_bytes",
)
_D = struct.Struct("<d")
TOUCH_EVERY = 1.0  # seconds a process keeps its uses' atimes before it writes them (``Index.touch``)
_log = logging.getLogger("datacache.cache.node")

# One environment per path per process: LMDB must not be opened twice in one process (closing
# either copy drops the process's fcntl locks on the lock file while the other is in use).
_envs: dict[str, list[Any]] = {}  # realpath -> [env, dbs, number of Index objects using it]
_envs_lock = threading.Lock()
_indexes: "weakref.WeakSet[Index]" = weakref.WeakSet()

# fork: an environment must not be used in a child, and closing an inherited one there is no
# better: it aborts the parent's transactions (those in flight in its other threads, and the spare
# read transaction py-lmdb caches), freeing reader slots the parent still uses. So ``fork`` waits
# until no transaction of this process is in flight, the parent closes its environments (cheap),
# and parent and child both re-open them on next use.
_gate = threading.Condition()
_in_flight = 0


def _enter_gate() -> None:
    global _in_flight
    with _gate:
        _in_flight += 1


def _leave_gate() -> None:
    global _in_flight
    with _gate:
        _in_flight -= 1
        if not _in_flight:
            _gate.notify_all()


@contextmanager
def _txn_gate() -> Iterator[None]:
    _enter_gate()
    try:
        yield
    finally:
        _leave_gate()


def _before_fork() -> None:
    _gate.acquire()  # held across the fork: no transaction starts meanwhile
    _gate.wait_for(lambda: not _in_flight)
    with _envs_lock:
        for env, _, _ in _envs.values():
            env.close()
        _envs.clear()
    for index in list(_indexes):
        index._pid = -1


def _after_fork_in_parent() -> None:
    _gate.release()


def _after_fork_in_child() -> None:
    global _gate, _in_flight, _envs_lock
    _gate, _in_flight, _envs_lock = threading.Condition(), 0, threading.Lock()
    for index in list(_indexes):
        index._lock = threading.Lock()  # another thread of the parent may have held it
        index._pending = {}  # the parent's deltas are the parent's to write
        index._atimes = {}  # and its uses


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def _open_env(path: str, map_size: int) -> tuple[Any, dict[str, Any]]:
    with _envs_lock:
        rec = _envs.get(os.path.realpath(path))
        if rec is None:
            env = lmdb.open(path, subdir=False, max_dbs=4, map_size=map_size, max_readers=2048, sync=False,
                            metasync=False, readahead=False)
            rec = [env, {n: env.open_db(n.encode()) for n in ("entries", "meta", "stats")}, 0]
            _envs[os.path.realpath(path)] = rec
        rec[2] += 1
        return rec[0], rec[1]


def _close_env(path: str) -> None:
    with _envs_lock:
        rec = _envs.get(os.path.realpath(path))
        if rec is not None:
            rec[2] -= 1
            if rec[2] <= 0:
                del _envs[os.path.realpath(path)]
                rec[0].close()


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
        """The entry ``raw`` encodes (``dumps``): a new object each call, which the caller may change."""
        parsed = _parsed.get(raw)
        if parsed is None:
            if len(_parsed) >= _PARSED_MAX:
                _parsed.clear()
            parsed = _parsed[raw] = json.loads(raw)
        size, digest, atime, tiers = parsed
        return cls(size, digest, atime, {name: dict(rec) for name, rec in tiers.items()})


# Entries decoded lately, by their bytes: a warm epoch reads each shard's entry once per run, and an
# entry's bytes change only when it does (its atime is written at most every ``TOUCH_EVERY``).
# Read-only once stored (``loads`` copies what it hands out); cleared when full. Thread-safe (one
# dict operation at a time).
_parsed: dict[bytes, Any] = {}
_PARSED_MAX = 1 << 14


class Index:
    """LMDB-backed index at ``<control dir>/index.lmdb``."""

    def __init__(self, control_dir: str, map_size: int = 1 << 30) -> None:
        self.path = os.path.join(control_dir, "index.lmdb")
        self._map_size = map_size
        self._env: Any = None
        self._pid = -1
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}
        self._atimes: dict[str, float] = {}  # uses (``touch``) not yet written, by key
        self._touched = time.monotonic()  # when they were last written
        self._warned = -1  # the pid that warned of a failed counter flush
        _indexes.add(self)

    @property
    def env(self) -> Any:
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():  # first use, or first use in a forked child
                    with self._translated("opened"):
                        self._env, self._dbs = _open_env(self.path, self._map_size)
                    self._pid = os.getpid()
        return self._env

    @contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        """LMDB's errors as one ``CacheError`` naming the index (from the original)."""
        try:
            yield
        except lmdb.Error as exc:
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: lmdb.Error) -> CacheError:
        return CacheError(f"the cache index could not be {what}: {exc}", url=self.path,
                          hint="Its file system is full or failing: free space there, or give the cache "
                               "other directories (ssd_dir / ram_dir, DATACACHE_SSD_DIR / DATACACHE_RAM_DIR)")

    @contextmanager
    def read(self) -> Iterator["Txn"]:
        with self._translated("read"), _txn_gate(), self.env.begin(write=False, buffers=False) as txn:
            yield Txn(txn, self._dbs)

    def get(self, key: str) -> Entry | None:
        """``key``'s entry, or None: ``read`` and ``Txn.get`` in one call (a cache lookup's, made
        for every run a reader reads, without the context managers' cost)."""
        return self.get_many((key,))[0]

    def get_many(self, keys: Iterable[str]) -> list[Entry | None]:
        """Each of ``keys``' entries (None where absent), in one read transaction."""
        env = self.env
        _enter_gate()
        try:
            with env.begin(write=False, buffers=False) as txn:
                db = self._dbs["entries"]
                raws = [txn.get(key.encode(), db=db) for key in keys]
        except lmdb.Error as exc:
            raise self._error("read", exc) from exc
        finally:
            _leave_gate()
        return [None if raw is None else Entry.loads(raw) for raw in raws]

    @contextmanager
    def write(self) -> Iterator["Txn"]:
        """A write transaction; per-process counter deltas are flushed into it (and kept pending
        if it fails). ``CacheError`` if LMDB fails (a full file system)."""
        taken: dict[str, float] = {}
        atimes: dict[str, float] = {}
        try:
            with self._translated("written"), _txn_gate(), self.env.begin(write=True) as txn:
                t = Txn(txn, self._dbs)
                with self._lock:
                    atimes, self._atimes, self._touched = self._atimes, {}, time.monotonic()
                t.apply_atimes(atimes)  # first: an eviction in this transaction sees this process's uses
                yield t
                with self._lock:  # after the body: what it counted goes into this transaction too
                    taken, self._pending = self._pending, {}
                t.add_counters(taken)
        except BaseException:
            if taken:
                self.count(**taken)
            with self._lock:
                for k, v in atimes.items():
                    self._atimes.setdefault(k, v)
            raise

    def count(self, **deltas: float) -> None:
        """Add to node-wide counters at the next write transaction (cheap, no I/O)."""
        with self._lock:
            for k, v in deltas.items():
                self._pending[k] = self._pending.get(k, 0.0) + v

    def touch(self, key: str) -> None:
        """Record a use of ``key`` now (its ``atime``, for the eviction policy): written with this
        process's next write transaction, at most ``TOUCH_EVERY`` seconds later. An eviction decided in
        this process sees it at once (it runs in a write transaction); other processes up to then."""
        now = time.time()
        with self._lock:
            self._atimes[key] = now
            due = time.monotonic() - self._touched >= TOUCH_EVERY
        if due:
            self.flush()

    def flush(self) -> None:
        """Write this process's pending counter deltas now (``stats``, ``close``). Where the index
        cannot be written (a full file system) they stay pending, with one warning per process:
        counters are not worth failing a training step for."""
        if not self._pending and not self._atimes:
            return
        try:
            with self.write():
                pass
        except CacheError as exc:
            if self._warned != os.getpid():
                self._warned = os.getpid()
                _log.warning("datacache: %s; the cache's counters wait until it can be written", exc)

    def close(self) -> None:
        self.flush()  # deltas not yet written (e.g. ``bypassed``, ``waited``) would be lost
        with _txn_gate(), self._lock:
            if self._env is not None and self._pid == os.getpid():
                _close_env(self.path)
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

    def apply_atimes(self, atimes: dict[str, float]) -> None:
        """Move each present key's ``atime`` forward to its use in ``atimes`` (``Index.touch``)."""
        for key, at in atimes.items():
            e = self.get(key)
            if e is not None and e.atime < at:
                e.atime = at
                self.put(key, e)

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
