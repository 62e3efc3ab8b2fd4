"""Placement: choosing victims for an insert, inside one short index transaction.

``make_room`` runs in a single LMDB write transaction: it ranks the tier's entries by the policy's
score, claims victims without blocking (the victim's key lock and an exclusive lock on its file,
so pinned entries and keys being worked on elsewhere are skipped), removes them from the index,
and records the new entry. Only cheap lock syscalls happen inside the transaction; copying a
demoted victim to SSD and unlinking files happen afterwards in ``Victim.finish``, while the victim's
key lock is still held, so an asker for that key waits and then finds it on SSD.
"""
from __future__ import annotations

import fcntl
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .index import Entry
from .tiers import KeyLock, Tier, key_id, unlock_close

if TYPE_CHECKING:
    from .cache import NodeCache

__all__ = ["make_room", "finish_all", "Victim"]

log = logging.getLogger("datacache.cache")


@dataclass
class Victim:
    """An entry removed from ``tier``'s index whose file is still locked by us."""

    key: str
    tier: Tier
    fname: str
    entry: Entry
    file_fd: int
    lock: KeyLock
    demote: bool = False

    def finish(self, cache: "NodeCache") -> None:
        """Demote to SSD if wanted, delete the file, release the locks. Never raises on SSD trouble."""
        path = self.tier.file_path(self.fname)
        try:
            if self.demote and cache.ssd.enabled:
                self._demote(cache, path)
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            if self.file_fd >= 0:
                unlock_close(self.file_fd)
            self.lock.release()

    def _demote(self, cache: "NodeCache", path: str) -> None:
        try:
            handle = cache.copy_in(self.key, path, cache.ssd, self.entry.size, self.entry.hash)
        except Exception as exc:  # e.g. an LMDB error: demotion is best effort
            log.warning("datacache: could not demote %s to SSD: %s", self.key, exc)
            return
        if handle is not None:
            if handle.tier == "ssd":
                cache.index.count(demotions=1)
            handle.release()


def finish_all(cache: "NodeCache", victims: list[Victim]) -> None:
    """Finish every victim even if one raises: a victim's key lock must not outlive the call."""
    error: BaseException | None = None
    for v in victims:
        try:
            v.finish(cache)
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


def _claim(cache: "NodeCache", tier: Tier, key: str, entry: Entry) -> Victim | None:
    lock = KeyLock(cache.lock_dir, key_id(key))
    if not lock.acquire(blocking=False):
        return None
    fname = entry.tiers[tier.name]["file"]
    try:
        fd = os.open(tier.file_path(fname), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = -1  # stale index record: claim it so it is dropped
    if fd >= 0:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # pinned by a reader
            os.close(fd)
            lock.release()
            return None
    return Victim(key, tier, fname, entry, fd, lock)


def _release(victims: list[Victim]) -> None:
    for v in victims:
        if v.file_fd >= 0:
            unlock_close(v.file_fd)
        v.lock.release()


def make_room(cache: "NodeCache", tier: Tier, key: str, nbytes: int, fname: str,
              digest: str) -> tuple[bool, list[Victim]]:
    """Record ``key`` (file ``fname`` of ``nbytes``) in ``tier``, evicting what the policy says.

    Returns ``(False, [])`` when the entry is not admitted (the policy bypasses it, or everything
    that could make room is pinned); the index is then unchanged.
    """
    policy = cache.policy
    victims: list[Victim] = []
    with cache.index.write() as txn:
        old = txn.get(key)
        old_rec = old.tiers.get(tier.name) if old else None
        need = txn.used(tier.name) + nbytes - (old.size if old_rec else 0) - tier.budget
        if need > 0:
            cands = sorted(((policy.score(k, e.atime), k, e) for k, e in txn.items()
                            if k != key and tier.name in e.tiers), key=lambda c: c[0], reverse=True)
            incoming = policy.incoming_score(key, cache.use_at(key))
            freed = 0
            for score, k, e in cands:
                if freed >= need or (policy.bypass and score <= incoming):
                    break
                v = _claim(cache, tier, k, e)
                if v is not None:
                    victims.append(v)
                    freed += e.size
            if freed < need:
                _release(victims)
                return False, []
            for v in victims:
                del v.entry.tiers[tier.name]
                v.demote = (tier.name == "ram" and v.file_fd >= 0 and cache.ssd.enabled and "ssd" not in v.entry.tiers
                            and v.entry.size <= cache.ssd.budget and policy.worth_keeping(v.key))
                txn.put(v.key, v.entry)
                txn.add_used(tier.name, -v.entry.size)
            cache.index.count(**{f"evictions_{tier.name}": len(victims)})
        entry = old or Entry(nbytes, digest, time.time(), {})
        if old_rec:  # replaced in place (e.g. after a failed verification): drop the old file later
            txn.add_used(tier.name, -entry.size)
            victims.append(Victim(key, tier, old_rec["file"], entry, -1, KeyLock(cache.lock_dir, "none")))
        entry.size, entry.hash, entry.atime = nbytes, digest, time.time()
        entry.tiers[tier.name] = {"file": fname, "token": cache.token}
        txn.put(key, entry)
        txn.add_used(tier.name, nbytes)
    return True, victims
