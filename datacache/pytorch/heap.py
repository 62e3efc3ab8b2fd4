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
import os
import threading

__all__ = ["reserve"]

_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems: larger frees move nothing
_lock = threading.Lock()
_state: dict[str, object] = {"pid": -1, "size": 0, "libc": None}


def _libc() -> ctypes.CDLL | None:
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


def reserve(nbytes: int) -> None:
    """Let the heap keep ``nbytes`` of values' memory between batches (see the module docstring)."""
    size = min(_MAX, 2 * nbytes + (1 << 20))  # room for the batch, and a value as large as all of it
    if size <= _state["size"] and _state["pid"] == os.getpid():  # type: ignore[operator]
        return
    with _lock:
        if _state["pid"] != os.getpid():
            _state.update(pid=os.getpid(), size=0, libc=_libc())
        libc = _state["libc"]
        if size <= _state["size"] or libc is None:  # type: ignore[operator]
            return
        block = libc.malloc(size)  # type: ignore[attr-defined]
        if block:
            libc.free(block)  # type: ignore[attr-defined]
        _state["size"] = size
