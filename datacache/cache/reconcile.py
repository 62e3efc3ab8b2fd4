"""Start-up reconciliation, the node lock, and bulk removal for ``NodeCache``.

Every process using a cache holds a shared ``flock`` on ``<control>/node.lock`` (``NodeLock``). A
process that can take it exclusively is alone: whatever the directories hold was left by processes
that are gone (possibly killed at any moment), so it reconciles the index with the files
(``reconcile``): temporary and pass-through files and orphans are removed, partial copies with
their states (``datacache.cache.partial``: scratch file and state are one unit), entries whose files are
missing or of the wrong size are dropped, tier usage is recomputed, and a new verification token is
issued so each surviving entry is re-hashed before it is first served.

The functions take the index and the tiers they work on, never the cache object.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import uuid
import weakref
from collections.abc import Callable, Mapping

from .._localfs import BUSY, GONE, KeyLock, key_id, lock_nonblocking, remove_if_exists, unlock_close
from .index import Index
from .tiers import Tier

__all__ = ["NodeLock", "reconcile", "clear"]

log = logging.getLogger("datacache.cache.node")
_PART_STATE = re.compile(r"[0-9a-f]{32}\.part(\.\d+\.tmp)?$")  # datacache.cache.partial's state (and its temp)
_UNIT_LOCK = re.compile(r"[0-9a-f]{32}\.(units|u[1-9]\d*)\.lock$")  # u<n>: one file per unit, as once
_held: "weakref.WeakSet[NodeLock]" = weakref.WeakSet()  # this process's joined node locks


class NodeLock:
    """This process's shared hold on a cache's ``node.lock``: ``join`` (reconciling first when
    alone), ``close``, and the rejoin in a forked child. Thread-safe for one joiner and closer."""

    def __init__(self, control_dir: str) -> None:
        self.path = os.path.join(control_dir, "node.lock")
        self._fd = -1

    def join(self, when_alone: Callable[[], dict[str, int]]) -> dict[str, int] | None:
        """Take the shared hold; if no other process holds the cache, run ``when_alone()`` first
        (under the exclusive lock) and return its report, else None."""
        fd = self._open()
        report = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a first opener reconciles
        else:
            try:
                report = when_alone()
            except BaseException:
                unlock_close(fd)
                raise
            fcntl.flock(fd, fcntl.LOCK_SH)
        self._fd = fd
        _held.add(self)
        return report

    def _open(self) -> int:
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def rejoin_after_fork(self) -> None:
        """In a forked child: take a shared hold on a new descriptor of our own. The inherited one
        shares its lock with the parent: unlocking it would drop the parent's hold and let a new
        opener reconcile under the parent's feet, so it is only closed."""
        inherited, self._fd = self._fd, -1
        if inherited < 0:
            return
        try:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
        except OSError as exc:
            log.warning("datacache: cannot rejoin the cache at %s after fork: %s", self.path, exc)
        finally:
            os.close(inherited)

    def close(self) -> None:
        """Release the hold. Idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            unlock_close(fd)


def _rejoin_after_fork() -> None:
    for lock in list(_held):
        lock.rejoin_after_fork()


os.register_at_fork(after_in_child=_rejoin_after_fork)


def reconcile(index: Index, tiers: Mapping[str, Tier], pass_dir: str, lock_dir: str) -> dict[str, int]:
    """Make ``index`` and the ``tiers``' directories (and ``pass_dir``) agree, and remove the
    partial copies' states from ``lock_dir`` with their scratch files; the caller must be alone on
    the node (``NodeLock.join``'s ``when_alone``). Returns what was removed."""
    report = {"partial": _remove_part_states(lock_dir), "orphans": 0, "missing": 0}
    with index.read() as txn:
        entries = dict(txn.items())
    referenced: dict[str, dict[str, str]] = {name: {} for name in tiers}
    for key, e in entries.items():
        for tname, rec in e.tiers.items():
            referenced.setdefault(tname, {})[rec["file"]] = key
    dirs = [(n, t.data_dir) for n, t in tiers.items()]
    if pass_dir not in {d for _, d in dirs}:  # pass files usually live in a tier's data dir
        dirs.append(("pass", pass_dir))
    sizes = _scan(dirs, referenced, report)
    used = {name: 0 for name in tiers}
    wrong: list[str] = []
    with index.write() as txn:
        for key, e in entries.items():
            for tname in list(e.tiers):
                fname = e.tiers[tname]["file"]
                if sizes.get((tname, fname)) != e.size:
                    if (tname, fname) in sizes:
                        wrong.append(tiers[tname].file_path(fname))
                    del e.tiers[tname]
                    report["missing"] += 1
                else:
                    used[tname] += e.size
            txn.put(key, e)
        for tname, n in used.items():
            txn.set_meta(f"used/{tname}", str(n))
        txn.set_meta("token", uuid.uuid4().hex)
    for path in wrong:  # no file I/O inside the write transaction
        remove_if_exists(path)
    if any(report.values()):
        log.warning("datacache: reconciled cache at %s after an unclean stop: removed %d partial files and %d "
                    "orphans, dropped %d entries whose files were missing or wrong", index.path,
                    report["partial"], report["orphans"], report["missing"])
    else:
        log.info("datacache: cache at %s is consistent (%d entries)", index.path, len(entries))
    return report


def _remove_part_states(lock_dir: str) -> int:
    """Remove the partial copies' states (``<kid>.part``, and a temp one a writer left) and unit
    locks (``<kid>.units.lock``; not ``u0``, which stays as a key's lock does) from ``lock_dir``;
    how many states went. Their scratch files are ``.tmp-`` files: ``_scan`` removes them."""
    removed = 0
    for de in os.scandir(lock_dir):
        if _PART_STATE.match(de.name):
            remove_if_exists(de.path)
            removed += 1
        elif _UNIT_LOCK.match(de.name):
            remove_if_exists(de.path)
    return removed


def _scan(dirs: list[tuple[str, str]], referenced: Mapping[str, Mapping[str, str]],
          report: dict[str, int]) -> dict[tuple[str, str], int]:
    """Remove temp, pass and orphan files from ``dirs``; the sizes of the referenced files."""
    sizes: dict[tuple[str, str], int] = {}
    for tname, data_dir in dirs:
        if not os.path.isdir(data_dir):
            continue
        for de in os.scandir(data_dir):
            if not de.is_file(follow_symlinks=False):
                continue
            if de.name.startswith((".tmp-", ".pass-")):
                remove_if_exists(de.path)
                report["partial"] += 1
            elif de.name not in referenced.get(tname, {}):
                remove_if_exists(de.path)
                report["orphans"] += 1
            else:
                sizes[(tname, de.name)] = de.stat().st_size
    return sizes


def clear(index: Index, tiers: Mapping[str, Tier], lock_dir: str, names: tuple[str, ...],
          dataset: str | None) -> int:
    """Remove the unpinned entries of the tiers ``names`` (only ``dataset``'s keys when given),
    skipping keys locked by a fetch. Returns how many files went."""
    removed = 0
    with index.read() as txn:
        keys = [k for k, _ in txn.items()]
    for key in keys:
        if dataset is not None and not key.startswith(dataset + "/"):
            continue
        lock = KeyLock(lock_dir, key_id(key))
        if not lock.acquire(blocking=False):
            continue
        try:
            removed += _clear_key(index, tiers, key, names)
        finally:
            lock.release()
    return removed


def _clear_key(index: Index, tiers: Mapping[str, Tier], key: str, names: tuple[str, ...]) -> int:
    doomed = []
    with index.write() as txn:
        e = txn.get(key)
        if e is None:
            return 0
        for tname in names:
            rec = e.tiers.get(tname)
            if rec is None:
                continue
            path = tiers[tname].file_path(rec["file"])
            fd = lock_nonblocking(path, exclusive=True)
            if fd == BUSY:  # pinned
                continue
            del e.tiers[tname]
            txn.add_used(tname, -e.size)
            doomed.append((path, fd))
        txn.put(key, e)
    for path, fd in doomed:
        remove_if_exists(path)
        if fd != GONE:
            unlock_close(fd)
    return len(doomed)
