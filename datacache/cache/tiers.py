"""Directory-backed cache tiers.

A ``Tier`` is a private directory (mode 0700, owned by us) holding entry files under ``data/``.
Entry files have unique names (``<key id>.<generation>``), so a delayed unlink of an old entry can
never remove a newer one. Temporary files start with ``.tmp-`` and pass-through files with
``.pass-``; neither is ever referenced by the index, so reconciliation may delete them. The locks
that make tiers safe to share across processes are in :mod:`datacache._localfs`.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from collections.abc import Iterator

from .._localfs import ensure_private_dir
from ..config import format_size
from ..errors import CacheError

__all__ = ["Tier"]

log = logging.getLogger("datacache.cache.node")

_MIN_TIER_BYTES = 16 << 20
# Kept free beside a tier that is shrunk to its file system: for the files written beside the
# budget (entries being fetched, pass-through copies, partial copies being completed) and the
# cache's own small files there (index, plans, batch rings). A third of what the tier could
# have, at most 1 GiB, and at least a tenth: on a 32 MB file system (1 MB shards, 8 threads)
# a quarter was too little for the entries being fetched and the pass-through copies still open.
_RESERVE_SHARE, _RESERVE_MAX, _RESERVE_MIN_SHARE = 1 / 3, 1 << 30, 0.1
_FLOOR_SHARE = 0.25  # of the reserve: never filled by the cache's data files (``has_room``)


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


