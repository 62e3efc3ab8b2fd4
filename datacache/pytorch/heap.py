"""Batch after batch, the training process's ``bytes`` and ``str`` values reuse warm heap memory.

Every batch's list of values is made in the training process and dropped a step later. glibc
gives the freed top of its heap back to the system once it exceeds its trim threshold, 128 KiB
until the process frees a larger block, so each batch's values land on fresh pages that the
kernel faults in and zeroes one by one: that costs as much as copying the values. glibc raises
that threshold by itself when a block it mapped (up to 32 MiB) is freed, to twice the block's
size (its dynamic mmap threshold, ``mallopt(3)``); :func:`reserve` frees one such block, sized
for the largest batch of values seen so far, so the heap keeps a batch's worth of free memory
for the next one. glibc ignores it where the user set the thresholds (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``, their ``GLIBC_TUNABLES``, ``mallopt``): their settings stand. Other C
libraries: nothing is done.

Thread-safe (a lock around the one malloc and free; the common call is one comparison).
"""
from __future__ import annotations

import ctypes
import threading

__all__ = ["reserve"]

_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems: larger frees move nothing
_lock = threading.Lock()
_reserved = 0  # the largest block freed so far (a forked child inherits the heap's state with it)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: musl and others keep their own policies
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    return libc


_LIBC = _glibc()


def reserve(nbytes: int) -> None:
    """Let the heap keep ``nbytes`` of values' memory between batches (see the module docstring)."""
    global _reserved
    size = min(_MAX, 2 * nbytes + (1 << 20))  # room for the batch, and a value as large as all of it
    if size <= _reserved or _LIBC is None:
        return
    with _lock:
        if size <= _reserved:
            return
        block = _LIBC.malloc(size)
        if block:
            _LIBC.free(block)
        _reserved = size
