"""Priority slots: at most ``n`` holders at a time, waiters admitted lowest priority value first.

The store uses one per process to cap ranged GETs in flight; the prefetcher passes each shard's
position in the read plan as its priority, so the shard needed next gets the link first instead of
sharing it with shards needed later (ties: first come, first served). Thread-safe; waiting blocks
on a condition variable (no polling).
"""
from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PrioritySlots"]


class PrioritySlots:
    """A counting semaphore whose waiters are served in priority order."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError("need at least one slot")
        self.n = n
        self._used = 0
        self._cond = threading.Condition()
        self._waiting: list[tuple[float, int]] = []
        self._tickets = itertools.count()

    @contextmanager
    def hold(self, priority: float = 0.0) -> Iterator[None]:
        ticket = (priority, next(self._tickets))
        with self._cond:
            heapq.heappush(self._waiting, ticket)
            while self._used >= self.n or self._waiting[0] != ticket:
                self._cond.wait()
            heapq.heappop(self._waiting)
            self._used += 1
            if self._waiting and self._used < self.n:
                self._cond.notify_all()  # the next in line may take a free slot too
        try:
            yield
        finally:
            with self._cond:
                self._used -= 1
                self._cond.notify_all()
