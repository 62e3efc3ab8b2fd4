"""Start-up reconciliation and bulk removal for ``NodeCache``.

Every process using a cache holds a shared ``flock`` on ``<control>/node.lock``. A process that can
take it exclusively is alone: whatever the directories hold was left by processes that are gone
(possibly killed at any moment), so it reconciles the index with the files: temporary and
pass-through files and orphans are removed, entries whose files are missing or of the wrong size
are dropped, tier usage is recomputed, and a new verification token is issued so each surviving
entry is re-hashed before it is first served.
"""
from __future__ import annotations

import fcntl
import logging
import os
import uuid
import weakref
from typing import TYPE_CHECKING

from .tiers import KeyLock, key_id, unlock_close

if TYPE_CHECKING:
    from .cache import NodeCache

__all__ = ["open_node", "join_node", "reconcile", "clear"]

log = logging.getLogger("datacache.cache")
_caches: "weakref.WeakSet[NodeCache]" = weakref.WeakSet()  # this process's open caches


def open_node(cache: "NodeCache") -> tuple[int, str, dict[str, int] | None]:
    """Join the node's cache: reconcile if alone. Returns (lock fd, token, report or None)."""
    fd = os.open(os.path.join(cache.control_dir, "node.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    report = None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a first opener reconciles
    else:
        report = reconcile(cache)
        fcntl.flock(fd, fcntl.LOCK_SH)
    with cache.index.read() as txn:
        token = txn.meta("token")
    if token is None:
        with cache.index.write() as txn:
            token = txn.meta("token") or uuid.uuid4().hex
            txn.set_meta("token", token)
    _caches.add(cache)
    return fd, token, report


def join_node(cache: "NodeCache") -> int:
    """A shared hold on the node lock on a new descriptor (a forked child's own); returns the fd."""
    fd = os.open(os.path.join(cache.control_dir, "node.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _rejoin_after_fork() -> None:
    """In a forked child, give each open cache its own shared hold on the node lock. The inherited
    descriptor shares its lock with the parent: unlocking it (``close()``) would drop the parent's
    hold and let a new opener reconcile under the parent's feet. It is only closed: the parent's
    copy keeps the parent's lock."""
    for cache in list(_caches):
        inherited = getattr(cache, "_node_fd", -1)
        if getattr(cache, "_closed", True) or inherited < 0:
            continue
        cache._node_fd = -1
        try:
            cache._node_fd = join_node(cache)
        except OSError as exc:
            log.warning("datacache: cannot rejoin the cache at %s after fork: %s", cache.control_dir, exc)
        finally:
            os.close(inherited)


os.register_at_fork(after_in_child=_rejoin_after_fork)


def reconcile(cache: "NodeCache") -> dict[str, int]:
    """Make the index and the tier directories agree (caller must be alone on the node)."""
    report = {"partial": 0, "orphans": 0, "missing": 0}
    with cache.index.read() as txn:
        entries = dict(txn.items())
    referenced = {name: {} for name in cache.tiers}
    for key, e in entries.items():
        for tname, rec in e.tiers.items():
            referenced.setdefault(tname, {})[rec["file"]] = key
    sizes: dict[tuple[str, str], int] = {}
    dirs = [(n, t.data_dir) for n, t in cache.tiers.items()]
    if cache.pass_dir not in {d for _, d in dirs}:  # pass files usually live in a tier's data dir
        dirs.append(("pass", cache.pass_dir))
    for tname, data_dir in dirs:
        if not os.path.isdir(data_dir):
            continue
        for de in os.scandir(data_dir):
            if not de.is_file(follow_symlinks=False):
                continue
            if de.name.startswith((".tmp-", ".pass-")):
                _unlink(de.path)
                report["partial"] += 1
            elif de.name not in referenced.get(tname, {}):
                _unlink(de.path)
                report["orphans"] += 1
            else:
                sizes[(tname, de.name)] = de.stat().st_size
    used = {name: 0 for name in cache.tiers}
    wrong: list[str] = []
    with cache.index.write() as txn:
        for key, e in entries.items():
            for tname in list(e.tiers):
                fname = e.tiers[tname]["file"]
                if sizes.get((tname, fname)) != e.size:
                    if (tname, fname) in sizes:
                        wrong.append(cache.tiers[tname].file_path(fname))
                    del e.tiers[tname]
                    report["missing"] += 1
                else:
                    used[tname] += e.size
            txn.put(key, e)
        for tname, n in used.items():
            txn.set_meta(f"used/{tname}", str(n))
        txn.set_meta("token", uuid.uuid4().hex)
    for path in wrong:  # no file I/O inside the write transaction
        _unlink(path)
    if any(report.values()):
        log.warning("datacache: reconciled cache at %s after an unclean stop: removed %d partial files and %d "
                    "orphans, dropped %d entries whose files were missing or wrong", cache.control_dir,
                    report["partial"], report["orphans"], report["missing"])
    else:
        log.info("datacache: cache at %s is consistent (%d entries)", cache.control_dir, len(entries))
    return report


def clear(cache: "NodeCache", tiers: tuple[str, ...], dataset: str | None) -> int:
    """Remove unpinned entries of ``tiers`` (only ``dataset``'s when given). Returns files removed."""
    removed = 0
    for key, _ in cache.entries():
        if dataset is not None and not key.startswith(dataset + "/"):
            continue
        lock = KeyLock(cache.lock_dir, key_id(key))
        if not lock.acquire(blocking=False):
            continue
        try:
            removed += _clear_key(cache, key, tiers)
        finally:
            lock.release()
    return removed


def _clear_key(cache: "NodeCache", key: str, tiers: tuple[str, ...]) -> int:
    removed = 0
    with cache.index.write() as txn:
        e = txn.get(key)
        if e is None:
            return 0
        doomed = []
        for tname in tiers:
            rec = e.tiers.get(tname)
            if rec is None:
                continue
            path = cache.tiers[tname].file_path(rec["file"])
            fd = _lock_nb(path)
            if fd == -2:  # pinned
                continue
            del e.tiers[tname]
            txn.add_used(tname, -e.size)
            doomed.append((path, fd))
        txn.put(key, e)
    for path, fd in doomed:
        _unlink(path)
        if fd >= 0:
            unlock_close(fd)
        removed += 1
    return removed


def _lock_nb(path: str) -> int:
    """-1: file missing; -2: pinned; else an fd holding an exclusive lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return -2
    return fd


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
