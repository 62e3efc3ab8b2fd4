"""The handles ``NodeCache.get`` returns, and the directory of pass-through copies.

A ``CacheHandle`` pins one entry file (a shared ``flock``) until released. Entries the policy does
not admit are served as *pass-through* copies: private files in ``PassDir``, deleted on release.
"""
from __future__ import annotations

import logging
import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from .._localfs import ensure_private_dir, remove_if_exists, unlock_close
from ..errors import CacheError
from .tiers import Tier

__all__ = ["CacheHandle", "PassDir"]

log = logging.getLogger("datacache.cache.node")


class CacheHandle:
    """A pinned local file holding one entry. ``path`` stays valid until ``release()``.

    ``tier`` is "ram", "ssd" or "pass" (not admitted: a private file deleted on release). Release
    is idempotent; a handle is also a context manager. Not thread-safe (one owner at a time).
    """

    def __init__(self, key: str, path: str, size: int, tier: str, fd: int) -> None:
        self.key, self.path, self.size, self.tier = key, path, size, tier
        self._fd = fd
        self._pid = os.getpid()
        self._lock = threading.Lock()

    @property
    def fd(self) -> int:
        return self._fd

    def mmap(self) -> mmap.mmap:
        """A read-only memory map of the entry (valid while the handle is held)."""
        return mmap.mmap(self._fd, 0, prot=mmap.PROT_READ) if self.size else mmap.mmap(-1, 1)

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

    def release(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd < 0:
            return
        if self._pid != os.getpid():  # a forked child's copy: the pin (and a pass file) are the parent's
            os.close(fd)
            return
        if self.tier == "pass":
            remove_if_exists(self.path)
        unlock_close(fd)

    def __enter__(self) -> "CacheHandle":
        return self

    def __exit__(self, *_: Any) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"CacheHandle({self.key!r}, tier={self.tier!r}, size={self.size})"


def fallback_bases() -> tuple[str, ...]:
    """File systems tried, in order, for pass-through copies after ENOSPC."""
    return ("/dev/shm", tempfile.gettempdir())


class PassDir:
    """Where pass-through copies are written: the fastest enabled tier's data directory, else a
    private ``pass`` directory beside the index; after ENOSPC there, a private directory on another
    file system (``/dev/shm`` or the temp dir). A copy that would leave the tier's file system
    without its reserve (``Tier.has_room``) goes to such a directory too, that copy alone
    (``dir_for``). Thread-safe."""

    def __init__(self, tiers: list[Tier], control_dir: str) -> None:
        enabled = [t for t in tiers if t.enabled]
        self.path = enabled[0].data_dir if enabled else ensure_private_dir(os.path.join(control_dir, "pass"))
        self._tiers = tiers
        self._lock = threading.Lock()

    def dir_for(self, size: int) -> str:
        """The directory for a pass-through copy of ``size`` bytes now: ``path``, or where that is
        a tier's directory without room for it, a private one on another file system with twice
        that free (``path`` still if there is none)."""
        current = self.path
        tier = next((t for t in self._tiers if t.data_dir == current), None)
        if tier is None or tier.has_room(size):
            return current
        for path in _elsewhere(current):
            if shutil.disk_usage(path).free >= 2 * size:
                return path
        return current

    def move_after(self, failed_dir: str, exc: OSError) -> bool:
        """Move to another file system after ENOSPC in ``failed_dir``; False when there is none left
        to try (True at once if another thread already moved)."""
        with self._lock:
            if self.path != failed_dir:
                return True
            for path in _elsewhere(self.path):
                self.path = path
                log.warning("datacache: no space for pass-through copies (%s); using %s and continuing", exc, path)
                return True
            return False


def _elsewhere(current: str) -> Iterator[str]:
    """Private pass-through directories on file systems other than ``current``'s (``fallback_bases``),
    created as they are yielded."""
    for base in fallback_bases():
        path = os.path.join(base, f"datacache-pass-{os.getuid()}")
        if not os.path.isdir(base) or os.path.realpath(path) == os.path.realpath(current):
            continue
        if os.path.exists(current) and os.stat(base).st_dev == os.stat(current).st_dev:
            continue
        try:
            ensure_private_dir(path)
        except (OSError, CacheError):  # e.g. another user made it first (/dev/shm is world-writable)
            continue
        yield path
