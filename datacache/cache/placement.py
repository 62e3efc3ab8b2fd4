"""Placement: choosing victims for an insert, inside one short index transaction.

``make_room`` runs in a single LMDB write transaction: it ranks the tier's entries by the policy's
score, claims victims without blocking (the victim's key lock and an exclusive lock on its file,
so pinned entries and keys being worked on elsewhere are skipped), removes them from the index,
and records the new entry. Only cheap lock syscalls happen inside the transaction. It returns the
victims, still locked: the cache demotes those marked ``demote`` (copying them to SSD) and then
calls ``Victim.drop``, while the victim's key lock is still held, so an asker for that key waits
and then finds it on SSD. Nothing here calls back into the cache.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .._localfs import BUSY, GONE, KeyLock, key_id, lock_nonblocking, remove_if_exists, unlock_close
from .eviction import INF, EvictionPolicy
from .index import Entry, Index
from .tiers import Tier

__all__ = ["make_room", "Victim"]


@dataclass
class Victim:
    """An entry removed from ``tier``'s index whose file is still locked by us (``file_fd`` is
    ``GONE`` for a stale record). ``demote``: the policy wants it copied to SSD before it goes."""

    key: str
    tier: Tier
    fname: str
    entry: Entry
    file_fd: int
    lock: KeyLock | None
    demote: bool = False

    @property
    def path(self) -> str:
        return self.tier.file_path(self.fname)

    def drop(self) -> None:
        """Delete the file and release the locks. Idempotent."""
        remove_if_exists(self.path)
        fd, self.file_fd = self.file_fd, GONE
        if fd >= 0:
            unlock_close(fd)
        if self.lock is not None:
            self.lock.release()


def _claim(lock_dir: str, tier: Tier, key: str, entry: Entry) -> Victim | None:
    lock = KeyLock(lock_dir, key_id(key))
    if not lock.acquire(blocking=False):
        return None
    fname = entry.tiers[tier.name]["file"]
    fd = lock_nonblocking(tier.file_path(fname), exclusive=True)
    if fd == BUSY:  # pinned by a reader
        lock.release()
        return None
    return Victim(key, tier, fname, entry, fd, lock)  # GONE: a stale index record, dropped


def _release(victims: list[Victim]) -> None:
    for v in victims:
        if v.file_fd >= 0:
            unlock_close(v.file_fd)
        if v.lock is not None:
            v.lock.release()


def _score(policy: EvictionPolicy, tier: Tier, key: str, entry: Entry) -> float:
    """``policy``'s score of ``key`` in ``tier``, except that the SSD copy of an entry RAM also holds
    (left by a promotion) goes first: dropping it costs nothing now, and RAM demotes the entry again
    when it evicts it. So the two tiers hold about RAM + SSD distinct bytes, not SSD bytes."""
    if tier.name == "ssd" and "ram" in entry.tiers:
        return INF
    return policy.score(key, entry.atime)


def make_room(index: Index, tier: Tier, key: str, nbytes: int, fname: str, digest: str, *,
              policy: EvictionPolicy, use_at: float | None, lock_dir: str, token: str,
              ssd: Tier) -> tuple[bool, list[Victim]]:
    """Record ``key`` (file ``fname`` of ``nbytes``, hash ``digest``) in ``tier``, evicting what
    ``policy`` says. ``use_at``: the read the insert is fetched for (MIN with bypass); ``lock_dir``:
    the key locks; ``token``: this cache generation's verification token; ``ssd``: where RAM
    victims may be demoted.

    Returns ``(False, [])`` when the entry is not admitted (the policy refuses it, ``admits``, or
    bypasses it, or everything that could make room is pinned); the index is then unchanged.
    Otherwise ``(True, victims)``: the caller must demote and ``drop`` every victim.
    """
    victims: list[Victim] = []
    if not policy.admits(key):
        return False, []
    with index.write() as txn:
        old = txn.get(key)
        old_rec = old.tiers.get(tier.name) if old else None
        need = txn.used(tier.name) + nbytes - (old.size if old_rec else 0) - tier.budget
        if need > 0:
            cands = sorted(((_score(policy, tier, k, e), k, e) for k, e in txn.items()
                            if k != key and tier.name in e.tiers), key=lambda c: c[0], reverse=True)
            incoming = policy.incoming_score(key, use_at)
            freed = 0
            for score, k, e in cands:
                if freed >= need or (policy.bypass and score <= incoming):
                    break
                v = _claim(lock_dir, tier, k, e)
                if v is not None:
                    victims.append(v)
                    freed += e.size
            if freed < need:
                _release(victims)
                return False, []
            for v in victims:
                del v.entry.tiers[tier.name]
                v.demote = (tier.name == "ram" and v.file_fd >= 0 and ssd.enabled and "ssd" not in v.entry.tiers
                            and v.entry.size <= ssd.budget and policy.worth_keeping(v.key))
                txn.put(v.key, v.entry)
                txn.add_used(tier.name, -v.entry.size)
            index.count(**{f"evictions_{tier.name}": len(victims)})
        entry = old or Entry(nbytes, digest, time.time(), {})
        if old_rec:  # replaced in place (e.g. after a failed verification): drop the old file later
            txn.add_used(tier.name, -entry.size)
            victims.append(Victim(key, tier, old_rec["file"], entry, GONE, None))
        entry.size, entry.hash, entry.atime = nbytes, digest, time.time()
        entry.tiers[tier.name] = {"file": fname, "token": token}
        txn.put(key, entry)
        txn.add_used(tier.name, nbytes)
    return True, victims
