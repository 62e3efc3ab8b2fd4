"""A private (copy-on-write) file mapping that hands out writable regions holding the file's bytes.

Samples read in place from a mapped file (the raw blocks of a ``.dcz`` shard) must be writable at
no cost: ``torch.as_tensor(s["x"]).zero_()`` and in-place normalisation are common. A read-only
mapping would make such a write a SIGSEGV. So the file is mapped ``MAP_PRIVATE`` with
``PROT_READ|PROT_WRITE`` (``mmap.ACCESS_COPY``): reading costs what a shared mapping costs (the
pages are the page cache's), and a write copies only the page written, privately, so it never
reaches the file.

A reader is kept open across epochs (``datacache._openshards``), so the same region is handed out
again later, and a page written in an earlier epoch must not leak into it, nor stay as private
memory. So :meth:`CowMap.region` first reclaims the regions that no view uses any more: where one
of their pages became a private copy (``/proc/self/pagemap``: present and not file-backed, or
swapped), the pages are dropped (``MADV_DONTNEED``: they refill from the file). A region whose
pages an earlier view still holds, and may have written, comes from a fresh private mapping
instead. Without a readable pagemap, every page handed out is treated as written.

A :class:`CowMap` is not thread-safe (one per reader, and a reader is used by one thread).
"""
from __future__ import annotations

import mmap
import os
import sys
import threading
import weakref
from typing import NamedTuple

import numpy as np

__all__ = ["CowMap", "Origin", "origin"]

_PAGE = mmap.PAGESIZE
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14: map pages, copy none
# References to an exporter that no view uses: its tuple in ``_out``, the loop variable, and
# getrefcount's argument.
_FREE_REFS = 3
# A pagemap entry's top byte: bit 7 present, bit 6 swapped, bit 5 file-backed. A page is as in the
# file when it is absent (refaulted from the file) or present and file-backed; else it is private.
_CLEAN = bytes(b for b in range(256) if b & 0xE0 in (0x00, 0xA0))


class Origin(NamedTuple):
    """Where a mapping's bytes come from: its first byte's address here, its length, and the file
    (an open descriptor of this process, the file's ``st_dev`` and ``st_ino``, the offset mapped
    first). Pages a view wrote are the one difference, and ``CowMap`` hands none out to read."""

    address: int
    length: int
    fd: int
    dev: int
    ino: int
    offset: int


_ORIGINS: "weakref.WeakKeyDictionary[mmap.mmap, Origin]" = weakref.WeakKeyDictionary()


def origin(m: mmap.mmap) -> Origin | None:
    """The file behind ``m``, a mapping a ``CowMap`` made (None for any other). Another process
    may map the same file to read the same bytes (``datacache.pytorch.crossread``); the
    descriptor is only valid while the ``CowMap``'s reader keeps it open, so such a reader checks
    ``dev`` and ``ino`` of what it opened."""
    return _ORIGINS.get(m)


_PAGEMAP: tuple[int, int | None] | None = None  # (pid, fd): one per process, opened on first use
_PAGEMAP_LOCK = threading.Lock()


def _pagemap() -> int | None:
    """This process's ``/proc/self/pagemap`` (None if unreadable); a forked child opens its own.
    Thread-safe."""
    global _PAGEMAP
    pid = os.getpid()
    with _PAGEMAP_LOCK:
        if _PAGEMAP is None or _PAGEMAP[0] != pid:
            if _PAGEMAP is not None and _PAGEMAP[1] is not None:
                os.close(_PAGEMAP[1])  # the parent's, inherited: it describes the parent's memory
            try:
                _PAGEMAP = (pid, os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                _PAGEMAP = (pid, None)
        return _PAGEMAP[1]


def _after_fork_in_child() -> None:
    global _PAGEMAP_LOCK
    _PAGEMAP_LOCK = threading.Lock()  # another thread of the parent may have held it


os.register_at_fork(after_in_child=_after_fork_in_child)


class CowMap:
    """``size`` bytes of the open file ``fd``, mapped copy-on-write (see the module docstring).

    ``map`` is the whole mapping (read the index and compressed frames through it);
    :meth:`region` gives writable views of the file's bytes.
    """

    def __init__(self, fd: int, size: int) -> None:
        self._fd, self._size = fd, size
        self.map = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        self._addr = _address(self.map)
        st = os.fstat(fd)
        self._file = (st.st_dev, st.st_ino)
        _ORIGINS[self.map] = Origin(self._addr, size, fd, *self._file, 0)
        self.use_pagemap = True  # False: treat every page handed out as written (tests)
        self._maybe = np.zeros(-(-size // _PAGE), dtype=bool)  # handed out, maybe written since
        self._populated = np.zeros(-(-size // _PAGE), dtype=bool)  # page tables filled (``_populate``)
        self._out: list[tuple[int, int, np.ndarray]] = []  # (first page, end page, exporter)

    def region(self, offset: int, length: int) -> memoryview:
        """A writable view of the file's bytes ``[offset, offset + length)``, as in the file."""
        p0, p1 = offset // _PAGE, -(-(offset + length) // _PAGE)
        self._reclaim()
        maybe = np.flatnonzero(self._maybe[p0:p1])  # pages an earlier, live view holds (often one)
        if len(maybe) and self._written(p0 + int(maybe[0]), p0 + int(maybe[-1]) + 1):
            return self._fresh(offset, length, p0)  # that view wrote here
        self._maybe[p0:p1] = True
        if not self._populated[p0:p1].all():
            self._populate(p0, p1)
        exporter = np.frombuffer(self.map, np.uint8, length, offset)
        self._out.append((p0, p1, exporter))
        return memoryview(exporter)

    def read_view(self, offset: int, length: int) -> memoryview:
        """The file's bytes ``[offset, offset + length)`` to read, never to write nor to hand out:
        as ``region`` but not tracked (no later region need check it), a fresh mapping only where a
        live view did write one of its pages."""
        p0, p1 = offset // _PAGE, -(-(offset + length) // _PAGE)
        maybe = np.flatnonzero(self._maybe[p0:p1])
        if len(maybe) and self._written(p0 + int(maybe[0]), p0 + int(maybe[-1]) + 1):
            return self._fresh(offset, length, p0)
        return memoryview(np.frombuffer(self.map, np.uint8, length, offset))

    def clean(self) -> bool:
        """Whether no view handed out and still alive may have written a page (every byte then
        reads as in the file through ``map``); reclaims first."""
        self._reclaim()
        return not self._maybe.any()

    def unwritten(self) -> bool:
        """Whether every byte reads as in the file through ``map`` now: no page is handed out, or
        none of those handed out (and alive) has been written (``/proc/self/pagemap``; unknown:
        False). Unlike ``clean`` it may stop holding at any time, as a live view may write; a
        caller that parses the file through ``map`` checks it before and after (a page once
        written stays a private copy until this map reclaims it, in the caller's thread)."""
        self._reclaim()
        held = np.flatnonzero(self._maybe)
        return not len(held) or not self._written(int(held[0]), int(held[-1]) + 1)

    def handed_out(self, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Which of the regions ``offsets``/``lengths`` hold a page that a view handed out and still
        alive may have written (the rest read as in the file through ``map``); reclaims first."""
        self._reclaim()
        if not self._maybe.any():
            return np.zeros(len(offsets), dtype=bool)
        held = np.concatenate(([0], np.cumsum(self._maybe)))
        return held[-(-(offsets + lengths) // _PAGE)] - held[offsets // _PAGE] > 0

    def _populate(self, p0: int, p1: int) -> None:
        """Fill the page tables of pages ``[p0, p1)`` read-only (MAP_POPULATE would copy every
        page), once per page: as regions are handed out, not for the whole file at the start,
        which cost 20 ms a 16 MB shard and delayed a part mix's first batch by that much per
        partial copy opened, most of whose pages are never read."""
        try:
            self.map.madvise(_POPULATE_READ, p0 * _PAGE, min(p1 * _PAGE, self._size) - p0 * _PAGE)
        except (OSError, ValueError):
            pass
        self._populated[p0:p1] = True

    def _reclaim(self) -> None:
        """Give the pages of regions no view uses any more back their file bytes."""
        live: list[tuple[int, int, np.ndarray]] = []
        dead: list[tuple[int, int]] = []
        for p0, p1, exporter in self._out:
            if sys.getrefcount(exporter) > _FREE_REFS:
                live.append((p0, p1, exporter))
            else:
                dead.append((p0, p1))
        self._out = live
        for p0, p1 in dead:
            lo, hi = p0, p1  # its pages, less those a live view shares (block boundaries)
            for a, b, _ in live:
                if a <= lo < b:
                    lo = b
                if a < hi <= b:
                    hi = a
            if lo >= hi or any(lo < a and b < hi for a, b, _ in live):
                continue
            if self._written(lo, hi):
                self.map.madvise(mmap.MADV_DONTNEED, lo * _PAGE, min(hi * _PAGE, self._size) - lo * _PAGE)
            self._maybe[lo:hi] = False

    def _written(self, p0: int, p1: int) -> bool:
        """Whether any page in ``[p0, p1)`` is a private copy (unknown: assume so)."""
        fd = _pagemap() if self.use_pagemap else None
        if fd is None:
            return True
        first = self._addr // _PAGE + p0
        try:
            raw = os.pread(fd, 8 * (p1 - p0), 8 * first)
        except OSError:
            return True
        if len(raw) != 8 * (p1 - p0):
            return True
        return bool(raw[7::8].translate(None, _CLEAN))  # a top byte that is not "clean" is left

    def _fresh(self, offset: int, length: int, p0: int) -> memoryview:
        """The region from a new private mapping of its pages (freed when its views are gone)."""
        start = p0 * _PAGE
        m = mmap.mmap(self._fd, offset + length - start, access=mmap.ACCESS_COPY, offset=start)
        _ORIGINS[m] = Origin(_address(m), len(m), self._fd, *self._file, start)
        return memoryview(m)[offset - start:offset - start + length]

    def close(self) -> None:
        """Unmap (deferred while views are alive: the mapping goes with the last); idempotent."""
        self._out = []
        try:
            self.map.close()
        except BufferError:  # views still alive: unmapped when they are gone
            pass


def _address(m: mmap.mmap) -> int:
    """The address of ``m``'s first byte (a writable mapping)."""
    probe = np.frombuffer(m, np.uint8, 1)
    return int(probe.ctypes.data)
