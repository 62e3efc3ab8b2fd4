"""Reusable decompression buffers: decoded blocks land in memory that is already mapped.

Decompressing a 16 MB shard into fresh ``bytes`` costs about three times the decompression itself
on this kind of machine: every new page is faulted in and zeroed by the kernel. A reader that
takes its block buffers from a :class:`BufferPool` instead writes into warm pages.

Safety invariant: a buffer is handed out again only when nothing but the pool refers to it. The
samples a reader returns are views into its block buffer (``numpy`` arrays and ``memoryview``
slices hold a reference to it), so a buffer whose samples are still alive anywhere (in a batch
being collated, in a user's list) is never overwritten; the pool just allocates another one.
That check is CPython's reference count, exact and cheap.

Thread-safe: ``take`` may be called from any thread; the pool's lock is held only while its list
is scanned (no I/O, no copying under it).
"""
from __future__ import annotations

import os
import sys
import threading

__all__ = ["BufferPool", "shared_pool"]

# References to a free pooled buffer while ``take`` inspects it: the pool's list, the loop
# variable, and getrefcount's own argument.
_FREE_REFS = 3


class BufferPool:
    """Up to ``max_buffers`` reusable ``bytearray`` buffers (see the module docstring)."""

    def __init__(self, max_buffers: int = 256) -> None:
        self.max_buffers = max_buffers
        self._buffers: list[bytearray] = []
        self._lock = threading.Lock()
        self.reused = self.allocated = 0

    def take(self, size: int) -> memoryview:
        """A writable view of exactly ``size`` bytes, in a buffer no one else refers to."""
        with self._lock:
            for buf in self._buffers:
                if size <= len(buf) <= 2 * size and sys.getrefcount(buf) == _FREE_REFS:
                    self.reused += 1
                    return memoryview(buf)[:size]
            buf = bytearray(size)
            self.allocated += 1
            if len(self._buffers) < self.max_buffers:
                self._buffers.append(buf)
            else:  # full of buffers still in use: replace the smallest, whose holders keep it alive
                smallest = min(range(len(self._buffers)), key=lambda i: len(self._buffers[i]))
                self._buffers[smallest] = buf
        return memoryview(buf)[:size]

    def clear(self) -> None:
        """Forget every buffer (those still referenced stay alive with their holders)."""
        with self._lock:
            self._buffers.clear()


_POOL: tuple[int, BufferPool] | None = None


def shared_pool() -> BufferPool:
    """This process's pool (a forked child starts its own: the parent's buffers stay the parent's)."""
    global _POOL
    pid = os.getpid()
    if _POOL is None or _POOL[0] != pid:
        _POOL = (pid, BufferPool())
    return _POOL[1]
