"""``NodePolicy``: Belady's MIN with bypass over the schedules of every dataset in use on the node.

A node cache shared by several datasets (two datasets of one job, or two jobs) must rank every
entry by its next use, whichever dataset it belongs to: a policy that knows one dataset's future
takes the other's entries as never used again, evicts them first, never demotes them and refuses
them admission, and both datasets thrash. So the policy holds one schedule per dataset, the
dataset of a key being its prefix (``<dataset id>/<shard>``, ``Manifest.cache_key``):

- in this process, the schedules told with ``tell`` (a dataset that tells again, e.g. for a new
  epoch, replaces its schedule);
- from other processes, the plans they published on the node's plan board
  (``datacache.cache.node.planboard``, under the cache's RAM directory, see ``for_cache``), with
  their clocks. ``tell`` publishes this process's schedule there and ``on_access`` (every cache
  ``get``) reads the other plans' clocks (one ``pread`` each) and, at most every ``rescan_s``
  seconds, looks for new, changed and stale plans. A plan whose clock has not moved for
  ``stale_s`` seconds is ignored; one that no process holds any more is removed.

Datasets progress on their own clocks (``epoch + position / n``), so an entry's score is its
distance to its next use on its dataset's clock (``Schedule.distance``), which compares datasets
at different epochs: exact when the datasets move through their epochs at the same pace (e.g.
read interleaved), a heuristic otherwise. A key no schedule knows is never used again (infinity).

Thread-safe: ``score`` and friends read an immutable snapshot and do no I/O (they run inside the
index's write transaction); ``tell``, ``on_access`` and ``close`` do their I/O outside the lock.
Fork-safe: a forked child forgets its parent's schedules and finds them on the board.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING

from ..errors import CacheError
from .eviction import INF, EvictionPolicy, Schedule
from .planboard import Foreign, PlanBoard, Published

if TYPE_CHECKING:
    from .node import NodeCache

__all__ = ["NodePolicy", "dataset_of", "DUPLICATE", "UNSCHEDULED"]

log = logging.getLogger("datacache.cache.node")

_policies: "weakref.WeakSet[NodePolicy]" = weakref.WeakSet()
DUPLICATE = 1e6  # added to the score of a copy a peer also holds (schedule distances are a few epochs)
UNSCHEDULED = DUPLICATE / 2  # the score of an owned entry no schedule knows


def dataset_of(key: Hashable) -> str:
    """The dataset id of a cache key (its prefix before "/"; "" for a key without one)."""
    head, sep, _ = str(key).partition("/")
    return head if sep else ""


class NodePolicy(EvictionPolicy):
    """MIN with bypass over every dataset's schedule (see the module docstring).

    ``board_dir``: where plans are shared with the node's other processes (``for_cache``; None:
    this process's schedules only).
    """

    name = "clairvoyant"
    clairvoyant = True
    bypass = True

    def __init__(self, board_dir: str | None = None, *, rescan_s: float = 0.2, stale_s: float = 1800.0) -> None:
        self._board = PlanBoard(board_dir) if board_dir is not None else None
        self.rescan_s, self.stale_s = rescan_s, stale_s
        self._lock = threading.Lock()
        self._scanning = threading.Lock()
        self._own: dict[str, tuple[Schedule, Published | None]] = {}
        self._foreign: dict[str, Foreign] = {}
        self._view: dict[str, tuple[Schedule, ...]] = {}  # dataset -> schedules; replaced, never mutated
        self._owned: dict[str, frozenset[str]] = {}  # dataset -> keys this node keeps for its peers; replaced
        self._next_scan = 0.0
        self._closed = False
        _policies.add(self)

    @classmethod
    def for_cache(cls, cache: "NodeCache") -> "NodePolicy":
        """The policy of ``cache``: plans shared under its RAM directory (transient, like the plans,
        and off the SSD file system that holds the index), else under its control directory."""
        for base in (cache.config.ram_dir, cache.control_dir):
            try:
                return cls(base)
            except (OSError, CacheError) as exc:
                log.warning("datacache: cannot share plans under %s (%s)", base, exc)
        log.warning("datacache: plans are not shared with other processes; with several jobs on this "
                    "node, make the cache's ram_dir or ssd_dir writable")
        return cls(None)

    # ------------------------------------------------------------------ scores (no I/O)
    def _distance(self, key: str, after: float | None = None) -> float:
        ds = dataset_of(key)
        schedules = self._view.get(ds)
        d = min(s.distance(key, after) for s in schedules) if schedules else INF
        owned = self._owned.get(ds)
        if owned is None:
            return d
        if key in owned:
            return d if d < INF else UNSCHEDULED
        return d + DUPLICATE

    def admits(self, key: str) -> bool:
        return key in self._owned.get(dataset_of(key), (key,))

    def stand_in(self, key: str) -> None:
        """Keep ``key`` as if owned, in this process: its owner could not fetch it for the job
        (``datacache.peer.tier``), so this node keeps the job's copy until the owner takes it."""
        ds = dataset_of(key)
        with self._lock:
            if ds in self._owned:
                self._owned = {**self._owned, ds: self._owned[ds] | {key}}

    def tell_owned(self, dataset: str, keys: frozenset[str]) -> None:
        """With the peer tier: ``keys`` are the entries of ``dataset`` this node keeps for the job
        (it owns them: ``datacache.peer.placement``). Every other shard of the dataset is one a peer
        keeps: it is never admitted (``admits``: served privately while it is read, as a bypassed
        entry is) and a copy already cached scores ``DUPLICATE`` beyond its next use, so it is
        evicted before any owned entry. So copies never crowd out the shards only this node holds,
        not even through pins (a pinned copy could not be evicted for an owned shard). An owned
        entry that no schedule knows yet scores ``UNSCHEDULED``: after every scheduled entry,
        before every copy. Kept across forks."""
        with self._lock:
            self._owned = {**self._owned, dataset: frozenset(keys)}

    def score(self, key: str, atime: float) -> float:
        return self._distance(key)

    def incoming_score(self, key: str, use_at: float | None = None) -> float:
        return self._distance(key, use_at)

    def worth_keeping(self, key: str) -> bool:
        return self._distance(key) < INF

    def should_promote(self, key: str) -> bool:
        return self._distance(key) < INF

    def datasets(self) -> dict[str, int]:
        """How many schedules (this process's and published ones) cover each dataset."""
        return {ds: len(s) for ds, s in self._view.items()}

    # ------------------------------------------------------------------ this process's plans
    def tell(self, schedule: Schedule) -> None:
        """Evict by ``schedule`` for the datasets of its keys (replacing this process's earlier
        schedule of each), and publish it for the node's other processes."""
        by_ds: dict[str, dict[Hashable, list[float]]] = {}
        for k, ts in schedule.times.items():
            by_ds.setdefault(dataset_of(k), {})[k] = ts  # type: ignore[assignment]
        now = schedule.now if schedule.now > -INF else schedule.start
        pubs = {ds: self._publish(ds, times, now) for ds, times in by_ds.items()}
        with self._lock:
            old = [self._own.pop(ds) for ds in by_ds if ds in self._own]
            self._own.update({ds: (schedule, pub) for ds, pub in pubs.items()})
            self._rebuild()
        for _, pub in old:
            if pub is not None:
                pub.close()
        published = [p for p in pubs.values() if p is not None]
        if published:
            schedule.on_advance = lambda t: [p.write_clock(t) for p in published]
        self.refresh(rescan=True)

    def _publish(self, dataset: str, times: dict[Hashable, list[float]], now: float) -> Published | None:
        """Publish on the board; best effort: a full or broken board only costs the sharing."""
        if self._board is None:
            return None
        try:
            return self._board.publish(dataset, times, now)
        except (OSError, CacheError) as exc:
            log.warning("datacache: cannot publish the plan of %s under %s, other processes will not see it: %s",
                        dataset, self._board.dir, exc)
            return None

    def _rebuild(self) -> None:
        """Recompute the snapshot ``score`` reads (called with the lock held)."""
        view: dict[str, list[Schedule]] = {ds: [s] for ds, (s, _) in self._own.items()}
        for f in self._foreign.values():
            if f.idle_for() <= self.stale_s:
                view.setdefault(f.dataset, []).append(f.schedule)
        self._view = {ds: tuple(s) for ds, s in view.items()}

    # ------------------------------------------------------------------ other processes' plans
    def on_access(self, key: str) -> None:
        """Before every cache ``get``: ``refresh``."""
        self.refresh()

    def refresh(self, rescan: bool = False) -> None:
        """Read the other plans' clocks and, if ``rescan`` or ``rescan_s`` have passed since the
        last scan, the plan board (new plans, and stale ones dropped). Any thread; a scan already
        running in another thread is not waited for."""
        if self._board is None or self._closed:
            return
        for f in list(self._foreign.values()):
            f.read_clock()
        if (not rescan and time.monotonic() < self._next_scan) or not self._scanning.acquire(blocking=False):
            return
        try:
            self._next_scan = time.monotonic() + self.rescan_s
            self._rescan()
        finally:
            self._scanning.release()

    def _rescan(self) -> None:
        assert self._board is not None
        with self._lock:
            skip = {pub.name for _, pub in self._own.values() if pub is not None}
            known = dict(self._foreign)
        names = self._board.scan(skip)
        loaded = {n: known.pop(n, None) or self._board.load(n) for n in names}
        with self._lock:
            self._foreign = {n: f for n, f in loaded.items() if f is not None}
            self._rebuild()
        for f in known.values():  # gone from the board
            f.close()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release this process's plans and forget the others'. Idempotent."""
        with self._lock:
            self._closed = True
            own, foreign = list(self._own.values()), list(self._foreign.values())
            self._own, self._foreign, self._view = {}, {}, {}
        for _, pub in own:
            if pub is not None:
                pub.close()
        for f in foreign:
            f.close()

    def _after_fork_in_child(self) -> None:
        self._lock, self._scanning = threading.Lock(), threading.Lock()
        for _, pub in self._own.values():
            if pub is not None:
                pub.forget()
        for f in self._foreign.values():
            f.forget()
        self._own, self._foreign, self._view, self._next_scan = {}, {}, {}, 0.0


def _after_fork_in_child() -> None:
    for p in list(_policies):
        p._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
