"""Local file and lock helpers shared by every layer: private directories, ``flock`` locks released by
the kernel when their holder dies, pins, pid checks and the atomic local replace.

- ``KeyLock``: one exclusive lock file per key; whoever holds it is the only one fetching,
  promoting or demoting that key on this node. Waiters block in the kernel (no polling).
- ``RangeLock``: exclusive locks on byte ranges of one lock file (the units of a partial copy),
  so that many small locks cost no file each.
- Pins: a reader holds a shared lock on a file itself (``try_pin``); an evictor must take an
  exclusive lock without blocking (``lock_nonblocking``), so a pinned file is never removed from
  under its reader.
- ``replace_local``: temp file, fsync, ``os.replace``: a crash leaves the old file or the new one.

Everything here is thread-safe: flock locks belong to open file descriptions, so two threads of one
process that open the same lock file exclude each other just like two processes do. Imports nothing
of datacache but ``errors``.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import xxhash

from .errors import CacheError

__all__ = ["BUSY", "GONE", "NO_SPACE_ERRNOS", "KeyLock", "RangeLock", "ensure_private_dir", "key_id",
           "lock_nonblocking", "pid_alive", "pinned_files", "remove_if_exists", "replace_local", "try_pin",
           "unlock_close"]


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


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


_FLOCK = struct.Struct("hhxxxxqqixxxx")  # struct flock (64-bit Linux): type, whence, start, len, pid


class RangeLock:
    """Exclusive locks on byte ranges of the file ``path``, across threads and processes: Linux
    open-file-description locks (``F_OFD_SETLKW``), which belong to an open file as ``flock``'s do,
    so each ``held`` opens the file anew and two threads of one process exclude each other as two
    processes do. Waiters block in the kernel; a holder that dies releases its range with its
    descriptors. Creating a lock file is what a lock costs on a disk's file system (a journal
    entry each): one file serves every range of a key."""

    def __init__(self, path: str) -> None:
        self.path = path

    @contextmanager
    def held(self, start: int, length: int) -> Iterator[None]:
        """Hold bytes ``[start, start + length)`` for the block (they need not exist in the file)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
            try:
                yield
            finally:  # explicitly: a forked child may share the open file description
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, start, length, 0))
        finally:
            os.close(fd)


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


def replace_local(path: str, data: bytes) -> None:
    """Atomically create or replace the local file ``path``: temp file, fsync, ``os.replace``."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
