"""The prefetcher: an ordered, byte-bounded, adaptive threaded map over a known sequence.

``Prefetcher(items, load, size_of=...)`` calls ``load(item)`` for the items of a sequence on a pool
of named threads, ahead of the consumer, and hands the results back in sequence order.

Back-pressure invariant: the bytes of items started but not yet taken by the consumer never exceed
the current lookahead budget, except that the next item the consumer needs may always start (so a
single item larger than the budget still flows). With ``slow_start``, only the first item starts
until one item has loaded. Results are therefore bounded in memory and, for
cache handles, in pinned bytes.

Adaptation (AIMD): when the consumer has to wait for an item, one more thread and one more average
item of lookahead are allowed (additive increase, up to ``max_threads`` and
``max_lookahead_bytes``); after a long run of takes without waiting, both are halved, never below
the configured starting values (multiplicative decrease). Concurrency hides per-request latency,
the byte budget bounds congestion.

An exception in ``load`` is re-raised in the consumer at that item's turn, with its original
traceback. ``close()`` is idempotent, wakes every thread, releases unconsumed results (via
``release``) and never blocks for long. All methods are thread-safe; one consumer at a time.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from ..config import PrefetchConfig

__all__ = ["Prefetcher"]


def _lower_priority(nice: int) -> None:
    """Make the calling thread ``nice`` steps nicer (Linux: per thread; elsewhere a no-op)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass

T = TypeVar("T")
R = TypeVar("R")
_WAIT_EPS = 1e-3
_CALM_TAKES = 16


class Prefetcher(Generic[T, R]):
    """Ordered threaded map with a byte budget (see the module docstring)."""

    def __init__(self, items: Sequence[T], load: Callable[[T], R], *, size_of: Callable[[T], int] = lambda _: 1,
                 release: Callable[[R], None] | None = None, config: PrefetchConfig | None = None,
                 name: str = "datacache-prefetch") -> None:
        self._items = list(items)
        self._load, self._size_of, self._release = load, size_of, release
        self.config = config or PrefetchConfig()
        self.name = name
        # One lock, three conditions: loaders wait for room (woken one at a time: a take wakes one,
        # and a loader that starts an item wakes the next while room is left), loaders beyond the
        # active count wait apart (woken when it changes), the consumer waits for its result
        # (woken by completions): no thread is woken only to find it has nothing to do.
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._spare = threading.Condition(lock)
        self._ready = threading.Condition(lock)
        self._results: dict[int, tuple[bool, Any]] = {}
        self._next_start = 0      # next index a thread will load
        self._next_take = 0       # next index the consumer takes
        self._started_bytes = 0   # bytes of items started and not yet taken
        self._threads: list[threading.Thread] = []
        self._active = self.config.threads
        self.lookahead = int(self.config.lookahead_bytes)
        self._calm = 0
        self._closed = False
        self._loaded = not self.config.slow_start  # whether an item has loaded (slow start over)
        self.wait_seconds = 0.0
        self.waits = 0
        mean = sum(map(size_of, self._items)) / max(len(self._items), 1)
        self._step = max(int(mean), 1)
        self._spawn(self._active)

    @classmethod
    def bounded(cls, items: Sequence[T], load: Callable[[T], R], *, ahead: int,
                size_of: Callable[[T], int] = lambda _: 1, release: Callable[[R], None] | None = None,
                name: str = "datacache-prefetch") -> "Prefetcher[T, R]":
        """One thread, at most ``ahead`` units started ahead of the consumer (items, or what
        ``size_of`` counts, e.g. samples), no adaptation: the plain pipeline stage (decoding,
        batching). ``load``, ``release``, ``name`` as for the constructor."""
        if ahead < 1:
            raise ValueError("Prefetcher.bounded: ahead must be >= 1 (items, or the units size_of counts), "
                             f"not {ahead}")
        config = PrefetchConfig(threads=1, max_threads=1, lookahead_bytes=ahead, max_lookahead_bytes=ahead,
                                adaptive=False, slow_start=False)
        return cls(items, load, size_of=size_of, release=release, config=config, name=name)

    # ------------------------------------------------------------------ threads
    def _spawn(self, n: int) -> None:
        while len(self._threads) < min(n, self.config.max_threads, max(len(self._items), 1)):
            t = threading.Thread(target=self._run, args=(len(self._threads),), daemon=True,
                                 name=f"{self.name}-{len(self._threads)}")
            self._threads.append(t)
            t.start()

    def _may_start(self, slot: int) -> bool:
        return slot < self._active and self._room()

    def _room(self) -> bool:
        """Whether the next item may start now (by an active thread)."""
        if self._closed or self._next_start >= len(self._items):
            return False
        if self._next_start == self._next_take:
            return True  # the consumer's next item may always start
        if not self._loaded:
            return False  # slow start: the first item has the link to itself
        return self._started_bytes + self._size_of(self._items[self._next_start]) <= self.lookahead

    def _run(self, slot: int) -> None:
        _lower_priority(self.config.nice)
        while True:
            with self._cond:
                while not self._may_start(slot):
                    if self._closed or self._next_start >= len(self._items):
                        return
                    (self._cond if slot < self._active else self._spare).wait()
                i = self._next_start
                self._next_start += 1
                self._started_bytes += self._size_of(self._items[i])
                if self._next_start >= len(self._items):
                    self._wake_all()  # every item started: the waiting threads end
                elif self._room():
                    self._cond.notify()  # room for one more: the next waiting loader
            try:
                result: tuple[bool, Any] = (True, self._load(self._items[i]))
            except BaseException as exc:  # handed to the consumer with its traceback
                result = (False, exc)
            with self._cond:
                closed = self._closed
                if not closed:
                    self._results[i] = result
                if not self._loaded:
                    self._loaded = True
                    self._cond.notify()  # slow start over: the lookahead may start (one wakes the next)
                if i == self._next_take or closed:
                    self._ready.notify()
            if closed:  # released outside the lock: a release may do I/O (a cache unpin)
                self._discard(result)

    def _discard(self, result: tuple[bool, Any]) -> None:
        if result[0] and self._release is not None:
            try:
                self._release(result[1])
            except Exception:
                pass

    # ------------------------------------------------------------------ consumer
    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[R]:
        while self._next_take < len(self._items):
            yield self.take()

    def take(self) -> R:
        """The next result in sequence order; blocks until it is loaded. Re-raises load errors."""
        with self._cond:
            i = self._next_take
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            if i >= len(self._items):
                raise StopIteration
            t0 = time.perf_counter()
            while i not in self._results:
                self._ready.wait()
                if self._closed:
                    raise RuntimeError(f"{self.name} was closed while waiting")
            waited = time.perf_counter() - t0
            ok, value = self._results.pop(i)
            self._next_take += 1
            self._started_bytes -= self._size_of(self._items[i])
            if self._adapt(waited):
                self._wake_all()  # the active count changed: every loader looks again
            else:
                self._cond.notify()  # room freed: one loader (it wakes the next while room is left)
        if not ok:
            raise value
        return value

    def _wake_all(self) -> None:
        self._cond.notify_all()
        self._spare.notify_all()

    def _adapt(self, waited: float) -> bool:
        """AIMD on threads and lookahead (called with the condition held); whether the number of
        active threads changed."""
        self.wait_seconds += waited
        before = self._active
        if waited > _WAIT_EPS:
            self.waits += 1
            self._calm = 0
            if self.config.adaptive:
                self._active = min(self._active + 1, self.config.max_threads)
                self.lookahead = min(self.lookahead + self._step, int(self.config.max_lookahead_bytes))
                self._spawn(self._active)
            return self._active != before
        self._calm += 1
        if self.config.adaptive and self._calm >= _CALM_TAKES:
            self._calm = 0
            self._active = max(self._active // 2, self.config.threads)
            self.lookahead = max(self.lookahead // 2, int(self.config.lookahead_bytes))
        return self._active != before

    @property
    def depth(self) -> int:
        """Items started ahead of the consumer (in flight or ready)."""
        with self._cond:
            return self._next_start - self._next_take

    @property
    def active_threads(self) -> int:
        return self._active

    def close(self, timeout: float = 5.0) -> None:
        """Stop, release unconsumed results and join threads (bounded by ``timeout``). Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending, self._results = self._results, {}
            self._wake_all()
            self._ready.notify_all()
        for result in pending.values():
            self._discard(result)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    def running(self) -> bool:
        """Whether a thread of this pool is still alive (``close`` gave up waiting for it)."""
        return any(t.is_alive() for t in self._threads if t is not threading.current_thread())

    def __enter__(self) -> "Prefetcher[T, R]":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()
