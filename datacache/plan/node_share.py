"""Plan work done once: per process (``memo``, a small LRU of results keyed by ``digest`` of their
inputs; ``readonly`` arrays), and per node: a result that every consumer of a node computes identically (the
run's shard-to-node assignment, the node's eviction schedule of an epoch) is computed by the first
of them and read by the others from the node cache's control directory.

Layout: ``<control dir>/nodeplan/<name>.npy``, one NumPy array written once, atomically (temp,
fsync, ``os.replace``), and mapped read-only by its readers (``np.load(mmap_mode="r")``: the
node's page cache holds one copy for all its processes). ``<name>`` is a digest of the inputs,
so a file never answers for other inputs. One computer at a time: it holds ``<name>.lock``
(``flock``); a consumer that finds the lock held polls for the file (every 1 ms at first, backing
off to 50 ms) for up to ``WAIT_S`` seconds, then computes the result itself (a stuck computer never
blocks the node). A file that fails the
caller's check (wrong shape, dtype or values) is recomputed and replaced, never used. Best effort:
a directory that cannot be written, or whose file system has less than ``RESERVE`` bytes free
(the cache index beside it needs them), costs only the sharing. At most ``KEEP`` files are kept (the
oldest go). Thread- and process-safe; no state.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from .._localfs import KeyLock, ensure_private_dir, remove_if_exists, replace_local
from ..errors import CacheError

__all__ = ["shared_array", "WAIT_S", "KEEP", "memo", "digest", "readonly"]

log = logging.getLogger("datacache.plan.epoch")
WAIT_S = 120.0
KEEP = 64
RESERVE = 16 << 20  # free bytes a plan file never takes: the cache index beside it must still grow
_POLL_S = 0.05
_FIRST_POLL_S = 0.001  # most results take milliseconds: poll soon, then back off to _POLL_S


def shared_array(directory: str | None, name: str, make: Callable[[], np.ndarray],
                 valid: Callable[[np.ndarray], bool]) -> np.ndarray:
    """``make()``, computed once per node under ``directory`` (see the module docstring) and
    returned as a read-only array (a read-only map of the shared file where it could be shared).
    ``name``: a file name unique to the inputs; ``valid``: whether a loaded array is the result."""
    if directory is None:
        return make()
    try:
        folder = ensure_private_dir(os.path.join(directory, "nodeplan"))
    except (OSError, CacheError) as exc:
        log.warning("datacache: plan work is not shared on this node (cannot use %s: %s)", directory, exc)
        return make()
    path = os.path.join(folder, name + ".npy")
    found = _load(path, valid)
    if found is not None:
        return found
    lock = KeyLock(folder, name)
    deadline = time.monotonic() + WAIT_S
    pause = _FIRST_POLL_S
    try:
        while not lock.acquire(blocking=False):
            found = _load(path, valid)
            if found is not None:
                return found
            if time.monotonic() > deadline:
                log.warning("datacache: %s is still being computed after %.0f s: computing it here too", path, WAIT_S)
                return make()
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S)
    except OSError as exc:
        log.warning("datacache: cannot lock %s (%s): computing the plan here", path, exc)
        return make()
    try:
        found = _load(path, valid)  # published while we waited for the lock
        if found is not None:
            return found
        value = make()
        if not _publish(path, value):
            return value
        shared = _load(path, valid)
        return value if shared is None else shared
    finally:
        lock.release()


def _load(path: str, valid: Callable[[np.ndarray], bool]) -> np.ndarray | None:
    """The array at ``path`` mapped read-only, or None (absent, unreadable, or failing ``valid``)."""
    try:
        value = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, EOFError) as exc:
        log.warning("datacache: ignoring unreadable plan file %s (%s): recomputing it", path, exc)
        return None
    if isinstance(value, np.ndarray) and valid(value):
        return value
    log.warning("datacache: ignoring plan file %s: not the expected result, recomputing it", path)
    return None


def _publish(path: str, value: np.ndarray) -> bool:
    """Write ``value`` to ``path`` atomically, then drop the oldest files beyond ``KEEP``."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(value), allow_pickle=False)
    try:
        st = os.statvfs(os.path.dirname(path))
        if st.f_bavail * st.f_frsize < buf.tell() + RESERVE:  # sharing is best effort; the index is not
            log.info("datacache: not sharing the plan file %s: its file system is nearly full", path)
            return False
        replace_local(path, buf.getvalue())
    except OSError as exc:
        log.warning("datacache: cannot share the plan file %s with the node's other processes: %s", path, exc)
        return False
    _prune(os.path.dirname(path))
    return True


def _prune(folder: str) -> None:
    try:
        files = [e for e in os.scandir(folder) if e.name.endswith(".npy")]
        files.sort(key=lambda e: e.stat().st_mtime)
    except OSError:
        return
    for entry in files[:-KEEP]:
        remove_if_exists(entry.path)
        remove_if_exists(entry.path[:-len(".npy")] + ".lock")


_memo_lock = threading.Lock()


_memo: OrderedDict[tuple[Any, ...], Any] = OrderedDict()


_MEMO_SIZE = 16


_digests: dict[int, tuple[weakref.ref, str]] = {}


def _after_fork() -> None:  # a DataLoader worker forked while another thread held the lock
    global _memo_lock
    _memo_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def readonly(values: Any, dtype: Any = np.int64) -> np.ndarray:
    """``values`` as a read-only array (int64 by default; whose digest is then computed once);
    a read-only array of that type as it is (no copy)."""
    if isinstance(values, np.ndarray) and values.dtype == dtype and not values.flags.writeable:
        return values
    out = np.array(values, dtype=dtype)
    out.flags.writeable = False
    return out


def digest(a: np.ndarray | None) -> str | None:
    """A short content digest of an array (memo keys); remembered for a read-only array (which
    cannot change), so the dataset's fixed arrays are hashed once."""
    if a is None:
        return None
    known = _digests.get(id(a))
    if known is not None and known[0]() is a:
        return known[1]
    out = hashlib.blake2b(np.ascontiguousarray(a, dtype=np.int64), digest_size=16).hexdigest() + f":{len(a)}"
    if isinstance(a, np.ndarray) and not a.flags.writeable and a.base is None:
        with _memo_lock:
            for k in [k for k, (ref, _) in _digests.items() if ref() is None]:
                del _digests[k]
            _digests[id(a)] = (weakref.ref(a), out)
    return out


def memo(key: tuple[Any, ...], make: Callable[[], Any], *, store: OrderedDict | None = None) -> Any:
    """``make()``, memoized under ``key`` (a small per-process LRU, or ``store``; the lock is not
    held while computing, so two threads may compute the same value once each)."""
    store = _memo if store is None else store
    with _memo_lock:
        if key in store:
            store.move_to_end(key)
            return store[key]
    value = make()
    with _memo_lock:
        store[key] = value
        while len(store) > _MEMO_SIZE:
            store.popitem(last=False)
    return value
