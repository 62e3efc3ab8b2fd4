"""Large ``bytes`` values read by the training process straight from the worker that found them.

A ``bytes`` value handed to the user must be a ``bytes`` object of the training process, so it is
copied there once whatever happens. Through the ring (``datacache.pytorch.batches``) it is copied
twice: by the worker, from the cached shard into the batch's slot, then by the training process,
out of the slot into the new object. For large values (encoded images, documents) the first copy
is a pass over every byte that buys nothing. Here the worker writes only each value's address in its own memory
and its length into the slot, keeps what the addresses point into alive (``BatchRing.hold``),
and the training process copies each value with ``process_vm_readv(2)`` straight into the new
``bytes`` object: one copy, one system call per 1,024 values.

A value in a tier file the worker has mapped (the raw blocks of a cached shard) is cheaper still
to copy from the training process's own mapping of that file (``_Files``): the worker writes the
file beside the address (its descriptor, ``st_dev``, ``st_ino`` and the offset:
``readers._cowmap.origin``), the training process opens it through ``/proc/<worker>/fd`` once and
keeps it mapped, and ``process_vm_readv`` stays for the values of any other memory.

Where it works (``available``, asked once per worker): Linux; the system call not refused (a
seccomp filter); the Yama ptrace scope 0 or 1 (1 lets a process read its descendants, and a
DataLoader's workers are the training process's children, or its grandchildren under
``forkserver``); ``DATACACHE_CROSS_READ`` not ``0``. Elsewhere the values go through the slot as
before.

Invariant: a value is read before its slot is free, and the worker drops what keeps its value's
memory alive only once the slot is free (``BatchRing.hold``): so the memory read is the value's.
A worker that exits before its batch is read (it cannot, in a DataLoader: every batch is
received, and read, before workers stop) makes the read fail with a ``CacheError`` naming it.

Thread-safe: ``read_values`` may run in any thread of the training process.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import resource
import stat
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from .._bytes import data_address, new
from ..errors import CacheError

__all__ = ["MIN_MEAN_BYTES", "WHERE", "available", "populate_write", "read_values", "values_read", "values_mapped"]

MIN_MEAN_BYTES = 4096  # a bytes column read across processes when its values average this much
_IOV_MAX = 1024  # iovecs per process_vm_readv call (Linux's UIO_MAXIOV)
_ENV = "DATACACHE_CROSS_READ"
WHERE = 5  # int64 words per value in a batch: its address, its file's descriptor, st_dev, st_ino and offset
_MAX_FILES = 256  # files mapped at most (``_Files``)
_MIN_EVICTED = 64  # files dropped for room before the mapped path may turn itself off
_CHECK_S = 1.0  # how often the mapped files are checked for deletion (seconds)

_libc: ctypes.CDLL | None = None
_checked: dict[tuple[int, int], bool] = {}  # (this pid, consumer pid) -> available
_count_lock = threading.Lock()
_values_read = 0
_values_mapped = 0


def values_read() -> int:
    """Values this process has read from other processes (``read_values``) so far."""
    return _values_read


def values_mapped() -> int:
    """Of those, the values copied from this process's own mapping of their file (``_Files``)."""
    return _values_mapped


def _call() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(_libc, "process_vm_readv", None)
    if fn is not None and fn.restype is not ctypes.c_ssize_t:
        fn.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                       ctypes.c_ulong)
        fn.restype = ctypes.c_ssize_t
    return fn


def _yama_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0  # no Yama: the ordinary same-user rule


def available(consumer: int) -> bool:
    """Whether process ``consumer`` (the training process, an ancestor of this one) can read this
    process's values (see the module docstring). Cached per process."""
    key = (os.getpid(), consumer)
    known = _checked.get(key)
    if known is None:
        known = _checked[key] = _probe(consumer)
    return known


def _probe(consumer: int) -> bool:
    if os.environ.get(_ENV, "1").strip() == "0" or consumer <= 1:
        return False
    fn = _call()
    if fn is None or _yama_scope() > 1:
        return False
    probe = b"datacache-cross-read-probe"
    out = ctypes.create_string_buffer(len(probe))
    iov = (ctypes.c_uint64 * 4)(ctypes.addressof(out), len(probe),
                                ctypes.cast(probe, ctypes.c_void_p).value or 0, len(probe))
    if fn(os.getpid(), ctypes.byref(iov), 1, ctypes.byref(iov, 16), 1, 0) != len(probe) or out.raw != probe:
        return False  # refused here (seccomp, no such call): it would be there too
    return True


def _read_iov(fn: Any, pid: int, iov: np.ndarray) -> None:
    """Read rows (local address, length, remote address, length) of ``iov`` from ``pid``."""
    for a in range(0, len(iov), _IOV_MAX):
        part = iov[a:a + _IOV_MAX]
        want = int(part[:, 1].sum())
        local = np.ascontiguousarray(part[:, :2])
        remote = np.ascontiguousarray(part[:, 2:])
        got = fn(pid, local.ctypes.data, len(part), remote.ctypes.data, len(part), 0)
        if got != want:
            code = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise CacheError(f"cannot read a batch's values from its DataLoader worker: {os.strerror(code)} "
                             f"({got} of {want} bytes)", url=f"pid {pid}",
                             hint=f"where this system forbids reading a child process's memory, set {_ENV}=0")


def read_values(pid: int, where: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    """New ``bytes`` objects holding process ``pid``'s values: value ``i`` is ``lengths[i]`` bytes
    at address ``where[i, 0]`` there, from the file ``where[i, 1:]`` (``WHERE``; descriptor -1:
    none). A value whose file this process maps too (``_Files``) is copied from its own mapping;
    the others are read from ``pid`` with ``process_vm_readv``."""
    sizes = lengths.tolist()
    out: list[bytes | None] = [None] * len(sizes)
    done = 0
    if len(sizes) and where.shape[1] == WHERE and FILES.on:
        done = FILES.copy(pid, where[:, 1:], sizes, out)
    if done < len(out):
        rest = [i for i, v in enumerate(out) if v is None]
        got = _read_from(pid, where[rest, 0], lengths[rest])
        for i, v in zip(rest, got):
            out[i] = v
    global _values_read
    with _count_lock:
        _values_read += len(out)
    return out  # type: ignore[return-value]


def _read_from(pid: int, addrs: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    fn = _call()
    if fn is None:
        raise CacheError("this system cannot read another process's memory, yet a batch's values were left "
                         "in its DataLoader worker's", url=f"pid {pid}", hint=f"set {_ENV}=0")
    sizes = lengths.tolist()
    out = [new(n) for n in sizes]  # filled below, before anyone sees them
    # local iovecs: each new object's data; remote: the worker's addresses (empty values left out)
    keep = lengths > 0
    iov = np.empty((int(keep.sum()), 4), np.uint64)
    iov[:, 0] = np.fromiter((data_address(b) for b, n in zip(out, sizes) if n), np.uint64, len(iov))
    iov[:, 1] = iov[:, 3] = lengths[keep]
    iov[:, 2] = addrs[keep]
    _read_iov(fn, pid, iov)
    return out


class _Files:
    """The files holding the producers' values (their tier files), mapped in this process too, so
    that a value is one ``memcpy`` from this process's own mapping: cheaper than
    ``process_vm_readv``, which pins each page of the other process's memory before copying it.

    A file is opened through ``/proc/<pid>/fd/<fd>`` (the producer's own open file, whatever its
    name now; allowed wherever ``process_vm_readv`` is) and used only if its ``st_dev`` and
    ``st_ino`` are the ones the producer sent: a descriptor closed and reused since names another
    file, and its values are then read from the producer's memory instead. Tier files are never
    written once their bytes are in a batch, so the file's bytes are the value's.

    Kept at most ``capacity`` files (least recently used dropped); a file deleted since (evicted) is
    dropped at the next check (``prune``: every ``_CHECK_S`` while batches come, and as each
    ``datacache.DataLoader`` iteration starts), so this process does not keep its space for long;
    ``close`` drops them all. Where most lookups miss (more files than ``capacity`` in turn), the
    path turns itself off for this process (``on``: a quarter as many files dropped for room as
    found), since opening and mapping a file per value costs more than the read it saves.
    Thread-safe; no lock is held while a file is opened or a value copied; a forked child starts
    empty."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: OrderedDict[tuple[int, int], tuple[int, tuple[mmap.mmap, int]]] = OrderedDict()
        self._checked = time.monotonic()
        self.hits = self.misses = self.evicted = self.adopted = 0
        self.on = os.environ.get(_ENV, "1").strip() != "0"
        self.capacity = _capacity()

    def copy(self, pid: int, files: np.ndarray, sizes: list[int], out: list[bytes | None]) -> int:
        """``out[i]`` <- value ``i`` from its file (row ``files[i]``: fd, dev, ino, offset; fd -1:
        none), where this process maps that file; left None otherwise. Returns how many were
        copied. Each distinct file of the call is looked up once."""
        if time.monotonic() - self._checked > _CHECK_S:
            self.prune()
        fds, devs, inos, offsets = files.T.tolist()
        maps: dict[tuple[int, int], tuple[mmap.mmap, int] | None] = {}
        done = 0
        for i, (fd, dev, ino, offset, n) in enumerate(zip(fds, devs, inos, offsets, sizes)):
            if fd < 0:
                continue
            key = (dev, ino)
            got = maps[key] if key in maps else maps.setdefault(key, self.view(pid, fd, dev, ino))
            if got is not None and 0 <= offset and offset + n <= got[1]:
                out[i] = got[0][offset:offset + n]  # a slice of an mmap is a new bytes: one copy
                done += 1
        global _values_mapped
        with _count_lock:
            _values_mapped += done
        return done

    def view(self, pid: int, fd: int, dev: int, ino: int) -> tuple[mmap.mmap, int] | None:
        """This process's mapping of the file (``st_dev``, ``st_ino``) open as ``fd`` in ``pid``,
        and its size; or None (not that file any more, not mappable, or the path is off)."""
        key = (dev, ino)
        with self._lock:
            got = self._maps.get(key)
            if got is not None:
                self._maps.move_to_end(key)
                self.hits += 1
                return got[1]
            self.misses += 1
        opened = _open_mapped(pid, fd, dev, ino)
        if opened is None:
            return None
        dropped: list[int] = []
        with self._lock:
            known = self._maps.get(key)
            if known is None:
                self._maps[key] = opened
                while len(self._maps) > self.capacity:
                    dropped.append(self._maps.popitem(last=False)[1][0])
                self.evicted += len(dropped)
                if self.evicted > _MIN_EVICTED and 4 * self.evicted > self.hits:
                    self.on = False  # more files in turn than it keeps: each value would open one
        for old in dropped:
            os.close(old)
        if known is None:
            return opened[1]
        os.close(opened[0])  # another thread mapped it meanwhile
        return known[1]

    def adopt(self, path: str) -> bool | None:
        """Map the file at ``path`` (a tier file whose values producers will send, found by this
        process itself: ``datacache.pytorch.tiermap``) and its pages now, so that the values copied
        from it later take no page fault each: ``MADV_POPULATE_READ``, through ``ctypes`` (the GIL
        released while the kernel maps them). True: mapped now or before; False: not now (gone,
        not a regular file); None: never, in this process (the path off, every place taken: a file
        is never dropped for one that is not yet in use; or no such ``madvise`` here)."""
        if not self.on or _populate is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            with self._lock:
                known, full = key in self._maps, len(self._maps) >= self.capacity
            if known or full or not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                os.close(fd)
                return True if known else None if full else False
            opened = fd, (mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ), st.st_size)
        except (OSError, ValueError):
            os.close(fd)
            return False
        if not _populate(opened[1][0], st.st_size):
            _unmap(opened)
            return None
        with self._lock:
            if key not in self._maps and len(self._maps) < self.capacity:
                self._maps[key] = opened
                self.adopted += 1
                return True
            known = key in self._maps
        _unmap(opened)
        return True if known else None

    def prune(self) -> None:
        """Drop the files deleted since they were mapped (their space is then free)."""
        self._checked = time.monotonic()
        with self._lock:
            held = list(self._maps.items())
        gone = []
        for key, (fd, _) in held:
            try:
                if os.fstat(fd).st_nlink == 0:
                    gone.append(key)
            except OSError:
                gone.append(key)
        with self._lock:
            dropped = [got[0] for got in (self._maps.pop(key, None) for key in gone) if got is not None]
        for fd in dropped:
            os.close(fd)

    def after_fork_in_child(self) -> None:
        """A forked child starts empty, with a lock of its own (another thread of the parent may
        have held the parent's); it closes its copies of the parent's descriptors."""
        inherited = [fd for fd, _ in self._maps.values()]
        self.__init__()  # type: ignore[misc]
        for fd in inherited:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Unmap every file (each mapping goes once no copy uses it); idempotent."""
        with self._lock:
            held, self._maps = list(self._maps.values()), OrderedDict()
        for fd, _ in held:
            os.close(fd)


def _capacity() -> int:
    """Files kept mapped: each holds two descriptors (ours and the mapping's own)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        soft = 1024
    return max(8, min(_MAX_FILES, (soft if soft > 0 else 1024) // 16))


def _open_mapped(pid: int, fd: int, dev: int, ino: int) -> tuple[int, tuple[mmap.mmap, int]] | None:
    """(descriptor, (read-only mapping, its size)) of the file open as ``fd`` in ``pid``, if it is (dev, ino).
    A descriptor reused since for a pipe or a device is never opened (stat first; and opened
    non-blocking, as a pipe's open would wait for a writer)."""
    link = f"/proc/{pid}/fd/{fd}"
    try:
        st = os.stat(link)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (dev, ino):
            return None
        own = os.open(link, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(own)
        if (st.st_dev, st.st_ino) != (dev, ino) or st.st_size == 0:
            os.close(own)
            return None
        return own, (mmap.mmap(own, st.st_size, prot=mmap.PROT_READ), st.st_size)
    except (OSError, ValueError):
        os.close(own)
        return None


def _unmap(opened: tuple[int, tuple[mmap.mmap, int]]) -> None:
    opened[1][0].close()
    os.close(opened[0])


def _populator(advice: int) -> Callable[[mmap.mmap, int], bool] | None:
    """``populate(m, size)``: map every page of ``m`` now, ``advice`` being ``MADV_POPULATE_READ``
    or ``MADV_POPULATE_WRITE`` (Linux 5.14 and later), without the GIL (a ``ctypes.CDLL`` call);
    False where the kernel does not know it. None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int

    def populate(m: mmap.mmap, size: int) -> bool:
        view = np.frombuffer(m, np.uint8, size)
        try:
            return madvise(view.ctypes.data, size, advice) == 0
        finally:
            del view  # the mapping may be closed once no view of it is left
    return populate


_populate = _populator(getattr(mmap, "MADV_POPULATE_READ", 22))
# A mapping this process will write, its pages present already (a batch ring's file is allocated
# when it is made): page tables filled once, writable, rather than a fault per page at its first write.
populate_write = _populator(getattr(mmap, "MADV_POPULATE_WRITE", 23))
FILES = _Files()
os.register_at_fork(after_in_child=FILES.after_fork_in_child)
