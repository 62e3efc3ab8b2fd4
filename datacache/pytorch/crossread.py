"""Large ``bytes`` values read by the training process straight from the worker that found them.

A ``bytes`` value handed to the user must be a ``bytes`` object of the training process, so it is
copied there once whatever happens. Through the ring (``datacache.pytorch.batches``) it is copied
twice: by the worker, from the cached shard into the batch's slot, then by the training process,
out of the slot into the new object. For large values (encoded images, documents) the first copy
is a pass over every byte that buys nothing. Here the worker writes only each value's address in its own memory
and its length into the slot, keeps what the addresses point into alive (``BatchRing.hold``),
and the training process copies each value with ``process_vm_readv(2)`` straight into the new
``bytes`` object: one copy, one system call per 1,024 values.

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
import os
import sys
import threading
from typing import Any

import numpy as np

from .._bytes import data_address, new
from ..errors import CacheError

__all__ = ["MIN_MEAN_BYTES", "available", "read_values", "values_read"]

MIN_MEAN_BYTES = 4096  # a bytes column read across processes when its values average this much
_IOV_MAX = 1024  # iovecs per process_vm_readv call (Linux's UIO_MAXIOV)
_ENV = "DATACACHE_CROSS_READ"

_libc: ctypes.CDLL | None = None
_checked: dict[tuple[int, int], bool] = {}  # (this pid, consumer pid) -> available
_count_lock = threading.Lock()
_values_read = 0


def values_read() -> int:
    """Values this process has read from other processes (``read_values``) so far."""
    return _values_read


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


def read_values(pid: int, addrs: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    """New ``bytes`` objects holding process ``pid``'s ``lengths[i]`` bytes at ``addrs[i]``."""
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
    global _values_read
    with _count_lock:
        _values_read += len(out)
    return out
