"""Pluggable eviction policies.

A policy ranks entries by a *score*: the entry with the highest score is evicted first.

- ``LRUPolicy``: score = -last access. Used when the future is unknown; admits everything and
  demotes every RAM victim to SSD (it cannot know what will be reused).
- ``ClairvoyantPolicy``: Belady's MIN with bypass. Score = the entry's next use in a known
  ``Schedule`` (infinity when it is never used again). An incoming entry is admitted only if every
  entry it displaces is next used later than it is; a RAM victim is demoted to SSD only if it is
  used again within the schedule's horizon, and SSD admission applies the same test, so nothing is
  written to SSD that will not be reused within the budget's horizon.
- ``node_policy.NodePolicy``: the same over the schedules of every dataset in use on the node (this
  process's and the other processes' published ones); what ``datacache.read.shard_source.tell_plan`` installs.

Bounds (D bytes read once per epoch through C < D bytes of cache): no policy hits more than C/D per
epoch, so remote bytes >= D - C per epoch; MIN reaches it; LRU hits nothing for a fixed order and
about c + (1-c) ln(1-c) for a reshuffled one (c = C/D).

Policies are thread-safe: ``Schedule.advance`` and lookups hold a small lock and never do I/O.
"""
from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

__all__ = ["EvictionPolicy", "LRUPolicy", "ClairvoyantPolicy", "Schedule"]

INF = math.inf


class EvictionPolicy:
    """Interface of an eviction policy (see the module docstring)."""

    name = "base"
    clairvoyant = False

    def score(self, key: str, atime: float) -> float:
        """Higher is evicted first."""
        raise NotImplementedError

    def incoming_score(self, key: str, use_at: float | None = None) -> float:
        """Score of an entry about to be inserted (compared against victims when ``bypass``);
        ``use_at`` is the time of the read it is fetched for, when fetched ahead of that read."""
        raise NotImplementedError

    bypass = False

    def admits(self, key: str) -> bool:
        """Whether ``key`` may enter the cache at all (False: it is served privately, even into free
        room; ``NodePolicy`` refuses copies a peer keeps for the job)."""
        return True

    def worth_keeping(self, key: str) -> bool:
        """Whether an evicted RAM entry should be demoted to SSD."""
        return True

    def should_promote(self, key: str) -> bool:
        """Whether an SSD hit should be copied into RAM."""
        return True

    def on_access(self, key: str) -> None:
        """Called on every ``get`` of ``key`` (before the lookup)."""

    def close(self) -> None:
        """Release what the policy holds (called by ``NodeCache.close`` and ``set_policy``)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first; the future is unknown."""

    name = "lru"

    def score(self, key: str, atime: float) -> float:
        return -atime

    def incoming_score(self, key: str, use_at: float | None = None) -> float:
        return -time.time()


class Schedule:
    """The known future: for each key, the sorted times at which it will be read, and ``now``.

    Times are floats; a consumer at plan position ``i`` of ``n`` in epoch ``e`` is at time
    ``e + i / n``, so the plans of several consumers (ranks, workers) of one node interleave on one
    clock. ``next_use(key)`` is the first time strictly after ``now``; ``distance(key)`` how far
    that is from ``now`` (from the first read before the clock starts), which compares the
    schedules of datasets at different epochs. ``on_advance(now)``, if set, is called after the
    clock moves (outside the lock; e.g. to publish it). Thread-safe.
    """

    def __init__(self, times: Mapping[Hashable, Sequence[float]], now: float = -INF) -> None:
        self._times = {k: sorted(v) for k, v in times.items()}
        self._now = now
        self._at: Hashable | None = None  # the key whose read is at ``now`` (auto-advance)
        self._lock = threading.Lock()
        self.start = min((ts[0] for ts in self._times.values() if ts), default=0.0)
        self.on_advance: Callable[[float], None] | None = None

    @classmethod
    def from_sequence(cls, keys: Iterable[Hashable]) -> "Schedule":
        """One consumer reading ``keys`` in order; time ``t`` is the position in the sequence."""
        times: dict[Hashable, list[float]] = {}
        for t, k in enumerate(keys):
            times.setdefault(k, []).append(float(t))
        return cls(times)

    @classmethod
    def from_plans(cls, plans: Mapping[int, Sequence[Sequence[Hashable]]]) -> "Schedule":
        """``plans[epoch]`` is a list of per-consumer key sequences; each consumer's reads spread
        evenly over ``[epoch, epoch + 1)``."""
        times: dict[Hashable, list[float]] = {}
        for epoch, consumers in plans.items():
            for seq in consumers:
                n = max(len(seq), 1)
                for i, k in enumerate(seq):
                    times.setdefault(k, []).append(epoch + i / n)
        return cls(times)

    @property
    def now(self) -> float:
        return self._now

    @property
    def times(self) -> Mapping[Hashable, Sequence[float]]:
        """Every key's sorted read times (do not modify)."""
        return self._times

    def advance(self, now: float) -> None:
        """Move the clock to ``now`` (never backwards)."""
        with self._lock:
            moved = now > self._now
            if moved:
                self._now, self._at = now, None
        if moved and self.on_advance is not None:
            self.on_advance(now)

    def advance_to_next(self, key: Hashable) -> None:
        """Move the clock to the next read of ``key`` at or after ``now`` (one-sequence use); a read
        of ``key`` at ``now`` that an earlier call already moved to is consumed, so consecutive
        reads of one key move on (``a a b``: 0, 1, 2)."""
        with self._lock:
            ts = self._times.get(key, ())
            i = bisect.bisect_left(ts, self._now)
            if i < len(ts) and ts[i] == self._now and self._at == key:
                i += 1
            moved = i < len(ts)
            if moved:
                self._now, self._at = ts[i], key
        if moved and self.on_advance is not None:
            self.on_advance(self._now)

    def next_use(self, key: Hashable, after: float | None = None) -> float:
        """The first read of ``key`` strictly after ``now`` (or after ``after``, if later)."""
        ts = self._times.get(key, ())
        i = bisect.bisect_right(ts, self._now if after is None else max(after, self._now))
        return ts[i] if i < len(ts) else INF

    def distance(self, key: Hashable, after: float | None = None) -> float:
        """``next_use(key, after)`` minus ``now`` (or minus ``start`` before the clock starts)."""
        now = self._now
        ts = self._times.get(key, ())
        i = bisect.bisect_right(ts, now if after is None else max(after, now))
        return ts[i] - (now if now > -INF else self.start) if i < len(ts) else INF

    def knows(self, key: Hashable) -> bool:
        return key in self._times


class ClairvoyantPolicy(EvictionPolicy):
    """Belady's MIN with bypass over a ``Schedule``.

    ``auto_advance=True`` moves the clock on each ``get`` (for a cache used by one consumer that
    reads exactly the schedule's sequence); otherwise the consumer calls ``schedule.advance``.
    """

    name = "clairvoyant"
    clairvoyant = True
    bypass = True

    def __init__(self, schedule: Schedule, *, auto_advance: bool = False) -> None:
        self.schedule = schedule
        self.auto_advance = auto_advance

    def score(self, key: str, atime: float) -> float:
        return self.schedule.next_use(key)

    def incoming_score(self, key: str, use_at: float | None = None) -> float:
        return self.schedule.next_use(key, after=use_at)

    def worth_keeping(self, key: str) -> bool:
        return self.schedule.next_use(key) < INF

    def should_promote(self, key: str) -> bool:
        return self.schedule.next_use(key) < INF

    def on_access(self, key: str) -> None:
        if self.auto_advance:
            self.schedule.advance_to_next(key)
