"""Directory-backed cache tiers and the kernel locks that make them safe to share across processes.

A ``Tier`` is a private directory (mode 0700, owned by us) holding entry files under ``data/``.
Entry files have unique names (``<key id>.<generation>``), so a delayed unlink of an old entry can
never remove a newer one. Temporary files start with ``.tmp-`` and pass-through files with
``.pass-``; neither is ever referenced by the index, so reconciliation may delete them.

Locks are ``flock`` locks, released by the kernel when their holder dies:

- ``KeyLock``: one exclusive lock file per key; whoever holds it is the only one fetching,
  promoting or demoting that key on this node. Waiters block in the kernel (no polling).
- Pins: a reader holds a shared lock on the entry file itself; an evictor must take an exclusive
  lock without blocking, so a pinned entry is never evicted from under its reader.

Everything here is thread-safe: flock locks belong to open file descriptions, so two threads of one
process that open the same lock file exclude each other just like two processes do.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import xxhash

from .config import format_size
from .errors import CacheError

__all__ = ["pid_alive", "Tier", "ensure_private_dir", "key_id", "KeyLock", "try_pin", "lock_nonblocking",
           "unlock_close", "pinned_files", "remove_if_exists", "GONE", "BUSY", "NO_SPACE_ERRNOS"]

log = logging.getLogger("datacache.cache")

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_MIN_TIER_BYTES = 16 << 20
# Kept free beside a tier that is shrunk to its file system: for the files written beside the
# budget (entries being fetched, pass-through copies, partial copies being completed) and the
# cache's own small files there (index, plans, batch rings). A third of what the tier could
# have, at most 1 GiB, and at least a tenth: on a 32 MB file system (1 MB shards, 8 threads)
# a quarter was too little for the entries being fetched and the pass-through copies still open.
_RESERVE_SHARE, _RESERVE_MAX, _RESERVE_MIN_SHARE = 1 / 3, 1 << 30, 0.1
_FLOOR_SHARE = 0.25  # of the reserve: never filled by the cache's data files (``has_room``)


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def key_id(key: str) -> str:
    """A filesystem-safe, fixed-length id for a cache key."""
    return xxhash.xxh3_128_hexdigest(key.encode())


def ensure_private_dir(path: str) -> str:
    """Create ``path`` with mode 0700 if needed; refuse it if another user owns it or it is a symlink."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise CacheError("cache directory is a symlink or not a directory", url=path,
                         hint="Point the cache at a real directory you own")
    if st.st_uid != os.getuid():
        raise CacheError(f"cache directory is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})",
                         url=path, hint="Use a directory you own (set ram_dir/ssd_dir or DATACACHE_*_DIR)")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


class Tier:
    """One cache tier: a budget in bytes and a private directory. Thread-safe: after init only
    ``disable`` and ``enabled`` change it. A tier disabled because its file system was full
    (``disable(full=True)``) turns itself on again once ``reserve`` bytes are free there
    (``enabled``), with its budget fitted to the file system again; one disabled for another
    reason stays off."""

    def __init__(self, name: str, path: str, budget: int) -> None:
        self.name = name
        self.path = path
        self.data_dir = os.path.join(path, "data")
        self.budget = self._wanted = int(budget)
        self.reserve = 0  # bytes kept free on the file system beside the budget (``_fit_free_space``)
        self._enabled = self._full = self._short = self._warned_short = False
        self._lock = threading.Lock()
        if self.budget <= 0:
            return
        try:
            ensure_private_dir(path)
            ensure_private_dir(self.data_dir)
            # Outside data/: a first opener reconciling right now would take it for a leftover.
            probe = os.path.join(path, f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except CacheError:
            raise
        except OSError as exc:
            log.warning("datacache: %s tier disabled: cannot write to %s (%s)", name, path, exc)
            return
        self._fit_free_space()

    def _fit_free_space(self, quiet: bool = False) -> bool:
        """Fit the budget to the file system: what it has free and what the tier holds, less the
        reserve (``_RESERVE_SHARE``). Whether the tier can be on (and it is then)."""
        usage = shutil.disk_usage(self.data_dir)
        ours = 0
        for e in os.scandir(self.data_dir):
            try:  # other processes' temp and pass files come and go while we look
                ours += e.stat(follow_symlinks=False).st_size if e.is_file(follow_symlinks=False) else 0
            except FileNotFoundError:
                pass
        room = usage.free + ours
        self.reserve = int(max(room * _RESERVE_MIN_SHARE, min(room * _RESERVE_SHARE, _RESERVE_MAX)))
        available, wanted = room - self.reserve, self._wanted
        if wanted > available:
            if available < _MIN_TIER_BYTES:
                if not quiet:
                    log.warning("datacache: %s tier disabled: only %s free at %s", self.name,
                                format_size(usage.free), self.path)
                return False
            if not quiet:
                log.warning("datacache: %s tier budget shrunk from %s to %s: that is what %s has free, less %s "
                            "kept free for the files the cache writes beside its entries", self.name,
                            format_size(wanted), format_size(available), self.path, format_size(self.reserve))
            wanted = available
        self.budget, self._enabled = wanted, True
        return True

    @property
    def enabled(self) -> bool:
        """Whether the tier takes new entries now; one disabled because its file system was full
        is on again once ``reserve`` bytes are free there (one ``statvfs`` per call while off)."""
        if self._enabled or not self._full:
            return self._enabled
        try:
            back = shutil.disk_usage(self.data_dir).free >= self.reserve
        except OSError:
            return False
        if back and self._fit_free_space(quiet=True):  # I/O outside the lock; threads may both re-fit
            with self._lock:
                said, self._full = not self._full, False
            if not said:
                log.warning("datacache: %s tier enabled again at %s: its file system has room again "
                            "(budget %s)", self.name, self.path, format_size(self.budget))
        return self._enabled

    def has_room(self, size: int) -> bool:
        """Whether a file of ``size`` bytes can be written into the tier's directory now and leave
        the floor of the reserve free (``_FLOOR_SHARE``: the cache's own small files there); a
        tier at its budget still has room for one entry being fetched, then evicts."""
        try:
            free = shutil.disk_usage(self.data_dir).free
        except OSError:
            return False
        room = free - size >= self.reserve * _FLOOR_SHARE
        if room == self._short:  # a change: one line when it starts (a warning the first time) and ends
            with self._lock:
                if room != self._short:
                    return room
                self._short, warned = not room, self._warned_short
                self._warned_short = True
            if room:
                log.info("datacache: %s tier at %s has room again", self.name, self.path)
            else:  # files still open beside the entries (samples of evicted shards) count too
                log.log(logging.INFO if warned else logging.WARNING,
                        "datacache: %s tier at %s is short of space (%s free, %s kept free beside its entries): "
                        "new entries skip it until there is room", self.name, self.path, format_size(free),
                        format_size(int(self.reserve * _FLOOR_SHARE)))
        return room

    def disable(self, why: str, *, full: bool = False) -> None:
        """Turn the tier off (one warning); ``full``: because its file system is full, so that it
        turns on again once there is room (``enabled``)."""
        with self._lock:
            if not self._enabled:
                return
            self._enabled, self._full = False, full
        log.warning("datacache: %s tier disabled at %s: %s; continuing without it%s", self.name, self.path, why,
                    " until its file system has room again" if full else "")

    def file_path(self, fname: str) -> str:
        return os.path.join(self.data_dir, fname)

    def new_name(self, kid: str) -> str:
        return f"{kid}.{uuid.uuid4().hex[:12]}"

    def temp_path(self, kid: str) -> str:
        """The one temp file of a key: only the holder of the key's lock writes it."""
        return os.path.join(self.data_dir, f".tmp-{kid}")

    def scan(self) -> Iterator[os.DirEntry[str]]:
        if os.path.isdir(self.data_dir):
            yield from os.scandir(self.data_dir)

    def __repr__(self) -> str:
        return f"Tier({self.name!r}, {self.path!r}, budget={format_size(self.budget)}, enabled={self.enabled})"


class KeyLock:
    """Exclusive per-key lock across threads and processes (``flock`` on ``<dir>/<key id>.lock``)."""

    def __init__(self, lock_dir: str, kid: str) -> None:
        self.path = os.path.join(lock_dir, f"{kid}.lock")
        self.fd = -1

    def acquire(self, blocking: bool = True) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            unlock_close(fd)

    @contextmanager
    def held(self) -> Iterator["KeyLock"]:
        self.acquire()
        try:
            yield self
        finally:
            self.release()


def unlock_close(fd: int) -> None:
    """Unlock explicitly before closing: a forked child may share the open file description."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


GONE = -1  # lock_nonblocking: the file does not exist
BUSY = -2  # lock_nonblocking: someone holds a conflicting lock


def lock_nonblocking(path: str, *, exclusive: bool) -> int:
    """Open ``path`` read-only and ``flock`` it (exclusive or shared) without blocking.

    Returns the descriptor holding the lock, ``GONE`` if the file does not exist, or ``BUSY`` if a
    conflicting lock is held (a pinned entry, for an exclusive request). The one non-blocking
    ``flock`` of the cache: pins, eviction claims and ``clear`` all use it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return GONE
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return BUSY
    return fd


def try_pin(path: str) -> int | None:
    """Open ``path`` with a shared lock; ``None`` if it is gone or being evicted. Returns the fd."""
    fd = lock_nonblocking(path, exclusive=False)
    if fd < 0:
        return None
    if os.fstat(fd).st_nlink == 0:  # unlinked between open and lock
        unlock_close(fd)
        return None
    return fd


def pinned_files(paths: list[str]) -> list[str] | None:
    """Those of ``paths`` that some process holds pinned now (a shared ``flock``, as ``try_pin``
    takes), read from Linux's ``/proc/locks`` (no lock is taken); None where that is unavailable.
    A snapshot: pins come and go."""
    try:
        with open("/proc/locks") as f:
            text = f.read()
    except OSError:
        return None
    held: set[tuple[int, int, int]] = set()
    for line in text.splitlines():  # "1: FLOCK  ADVISORY  READ  1234 08:01:5678 0 EOF"; waiters have "->"
        f = line.split()
        if len(f) >= 6 and f[1] == "FLOCK" and f[3] == "READ":
            major, minor, inode = f[5].split(":")
            held.add((int(major, 16), int(minor, 16), int(inode)))
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in held:
            out.append(path)
    return out


def remove_if_exists(path: str) -> None:
    """``os.unlink`` that ignores a file that is already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
