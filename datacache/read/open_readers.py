"""Shard readers kept open across runs and epochs, so a warm epoch maps no page twice.

Opening a 16 MB cached shard costs little, but mapping its pages costs about 0.4 µs per 4 KiB
page, as much as copying them again. A process that reads the same cached shards every epoch
keeps their readers (and mappings) here, keyed by path and reader options and checked against the file's identity
(inode, size, mtime) at every use: an entry the cache has replaced or evicted is closed, never
read. Mappings of files the cache has since deleted are closed by a sweep at most once a second
(at a ``checkout`` or ``checkin``), so they hold memory the cache has given back only that long.

Thread-safe: a reader is checked out by one thread at a time (readers are not thread-safe) and
checked back in when that thread is done; the lock is never held while a file is opened or read.
"""
from __future__ import annotations

import atexit
import collections
import os
import resource
import threading
import time
from typing import Any

from ..readers import ShardFormat

__all__ = ["OpenShards", "default_max_open", "open_shards"]


class OpenShards:
    """Up to ``max_open`` idle readers of local shard files (see the module docstring; by default
    a quarter of the process's descriptor limit, ``default_max_open``), holding at most
    ``max_held`` bytes of memory of their own (``held_bytes``: a compressed MDS or LitData shard's
    inflated copy; mappings are not counted) beside the newest one."""

    def __init__(self, max_open: int | None = None, sweep_every: float = 1.0, max_held: int = 256 << 20) -> None:
        self.max_open = default_max_open() if max_open is None else max_open
        self.sweep_every, self.max_held = sweep_every, max_held
        self._swept = 0.0
        self._holding = False  # whether a reader ever held memory of its own (else none is summed)
        self._idle: collections.OrderedDict[tuple[str, str, str], tuple[Any, tuple[int, int, int]]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    def checkout(self, fmt: ShardFormat, path: str, options: dict[str, Any], *, tables: bool = False,
                 fd: int | None = None) -> Any:
        """An open reader of ``path`` (reused if its file is unchanged); give it back with ``checkin``.
        ``tables``: the caller reads this file as tables, now or in a later epoch: a reader handed
        out again (so one kept across reads), or opened now where the pool has room to keep it,
        makes its whole-shard table first, where it can and has none
        (``ShardReader.prepare_tables``), in the caller's thread. ``fd``: a descriptor
        of the file ``path`` names, held open by the caller for as long as the reader is out (a
        cache entry's pin): the file's identity is taken from it, without a lookup of ``path``."""
        identity = _identity(path if fd is None else fd)
        key = (fmt.name, path, _options_key(options))
        with self._lock:
            entry = self._idle.pop(key, None)
            idle = self._due()
        for r in self._drop_stale(idle):
            r.close()
        if entry is not None:
            if entry[1] == identity:
                if tables:
                    _prepare(entry[0])
                return entry[0]
            entry[0].close()
        reader = fmt.open(path, **options)
        reader._datacache_identity = identity
        if tables and self._room(key):  # made at checkin anyway: now, its first read takes rows from it
            _prepare(reader)
        return reader

    def checkin(self, fmt: ShardFormat, path: str, reader: Any, options: dict[str, Any], *,
                tables: bool = False) -> None:
        """Keep ``reader`` for the next run of the same file with the same ``options``. ``tables``:
        as ``checkout``'s; a reader the pool has room for (it evicts no other to keep it) makes
        its whole-shard table now, in the caller's thread, so that a shard read once (a cold
        epoch's) has it before its first columnar read. Where the pool is full (a process reading
        more shards than it keeps open), the reader may be closed before its next read, and its
        table is left to that read's ``checkout``."""
        key = (fmt.name, path, _options_key(options))
        if tables and self._room(key):
            _prepare(reader)
        with self._lock:
            old = self._idle.pop(key, None)
            self._idle[key] = (reader, reader._datacache_identity)
            over = [self._idle.popitem(last=False)[1][0] for _ in range(len(self._idle) - self.max_open)]
            self._holding = self._holding or _held(reader) > 0  # only some formats' readers hold memory
            held = sum(_held(r) for r, _ in self._idle.values()) if self._holding else 0
            while held > self.max_held and len(self._idle) > 1:  # the oldest first, never the newest
                out = self._idle.popitem(last=False)[1][0]
                held -= _held(out)
                over.append(out)
            idle = self._due()
        for r in ([old[0]] if old else []) + over + self._drop_stale(idle):
            r.close()

    def _room(self, key: tuple[str, str, str]) -> bool:
        """Whether the reader of ``key`` checked in now would be kept without evicting another."""
        with self._lock:
            return len(self._idle) - (key in self._idle) < self.max_open

    def _due(self) -> list[tuple[tuple[str, str, str], tuple[int, int, int]]]:
        """The idle entries to check now: all of them, once per ``sweep_every`` (under the lock)."""
        now = time.monotonic()
        if now - self._swept < self.sweep_every:
            return []
        self._swept = now
        return [(k, ident) for k, (_, ident) in self._idle.items()]

    def _drop_stale(self, idle: list[tuple[tuple[str, str, str], tuple[int, int, int]]]) -> list[Any]:
        """Take out the idle readers whose file is gone or replaced (``stat`` outside the lock)."""
        stale = [(key, ident) for key, ident in idle if _identity(key[1]) != ident]
        out = []
        with self._lock:
            for key, ident in stale:
                entry = self._idle.get(key)
                if entry is not None and entry[1] == ident:
                    out.append(self._idle.pop(key)[0])
        return out

    def close(self) -> None:
        """Close every idle reader. Idempotent."""
        with self._lock:
            idle, self._idle = list(self._idle.values()), collections.OrderedDict()
        for reader, _ in idle:
            reader.close()


def default_max_open() -> int:
    """Idle readers kept by default: a quarter of the process's soft limit on open descriptors
    (each reader holds one), between 64 and 4,096. A process reading more shards than this
    reopens and maps them again as it reads them."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        soft = 1024
    if soft == resource.RLIM_INFINITY or soft <= 0:
        soft = 1 << 16
    return max(64, min(4096, soft // 4))


def _held(reader: Any) -> int:
    return getattr(reader, "held_bytes", 0)


def _options_key(options: dict[str, Any]) -> str:
    """Readers opened with other options are other readers (an MDS reader decoding images or not)."""
    return repr(sorted(options.items())) if options else ""


def _prepare(reader: Any) -> None:
    """``reader.prepare_tables()``; a reader that fails it is closed (neither handed out nor kept,
    it would stay mapped) and the error raised."""
    try:
        reader.prepare_tables()
    except BaseException:
        reader.close()
        raise


def _identity(path: str | int) -> tuple[int, int, int]:
    """(inode, size, mtime) of the file at ``path``, or open as descriptor ``path``; -1s if gone."""
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1, -1)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


_SHARED: tuple[int, OpenShards] | None = None


def open_shards() -> OpenShards:
    """This process's cache of open readers (a forked child starts an empty one)."""
    global _SHARED
    if _SHARED is None or _SHARED[0] != os.getpid():
        _SHARED = (os.getpid(), OpenShards())
    return _SHARED[1]


def _after_fork_in_child() -> None:
    """Unmap the parent's idle readers in a forked child (e.g. a DataLoader worker): the child
    would otherwise keep pages of files the cache deletes alive for its whole life."""
    global _SHARED
    if _SHARED is not None:
        inherited, _SHARED = _SHARED[1], None
        inherited._lock = threading.Lock()  # the parent's may have been held by another thread
        inherited.close()


def _close_at_exit() -> None:
    if _SHARED is not None and _SHARED[0] == os.getpid():
        _SHARED[1].close()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_at_exit)
