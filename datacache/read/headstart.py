"""A head start for a cold epoch: the training process fetches its DataLoader workers' first
shards while the workers are still starting.

A worker's first request leaves a few hundred milliseconds after ``iter(loader)``: the fork, the
worker's plan and node schedule, its own S3 client. On a link-bound cold epoch the link idles that
long (``tools/bench.py``'s link timelines: 0.3 s for one rank, 0.6 s for two on two cores). The
training process already holds an open store and the node cache, and it can compute each worker's
plan, so ``datacache.DataLoader`` starts one ``HeadStart`` right after the workers have forked (a
thread started before the fork could leave its locks held in the children). It fetches each
worker's first runs' shards in the order the workers read them, one at a time, through the one
shard path (``ShardSource.fetch``): a worker that asks for a shard the head start is fetching waits
for that download (one fetch per key in flight, across processes), and a cached shard costs a pin
and a release. A failure is left to the worker, whose own fetch raises it where the training loop
sees it. It fetches only into free room: a shard already cached is skipped, and once no tier has
room for the next one the head start ends, since the workers have not yet told the cache this
epoch's plan (``shards.tell_plan``), and an eviction decided now could throw out a shard the
epoch still needs (with a cache smaller than the data, epochs after the first get no head start).
A shard the cache does not admit (served privately, "pass") ends it too: the worker would
download it again. ``close()`` abandons a download in flight at once (``cancelled``) and is idempotent.
The workers themselves get one another's first shards in the same order (``fetch_ahead``, the
``Consumer``'s lead): with or without a head start, those arrive one after another.
A part-mixed cold epoch (``datacache.plan.part_shuffle``) has no first shards: each worker's first
chunks read a few blocks of many shards. Its head start loads those runs' rows into the shards'
partial copies (``ShardSource.load_rows``: each block fetched once per node, across processes)
on a few threads, since a block is a small read that one thread would leave the link idle behind
(``datacache.pytorch.dataset.head_start``). Thread-safe: its threads are the object's only users besides ``close()``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["HeadStart", "Lead", "RUNS_PER_WORKER", "fetch_ahead", "first_chunks"]

log = logging.getLogger("datacache.pytorch.dataset")

RUNS_PER_WORKER = 2  # the first two runs: a worker's first step needs its first run, the next its second


def first_chunks(plan: Any, epoch: int, chunks: int) -> list[tuple[int, int, float, list[int]]]:
    """The runs of the first ``chunks`` chunks of a part-mixed ``plan`` (a ``ConsumerPlan`` with
    ``parts``) in ``epoch``: (chunk index, shard, next-use time, shard-local rows) each, in plan
    order; empty for any other plan."""
    if not plan.parts or plan.rows is None:
        return []
    starts = plan.run_starts.tolist()
    firsts = sorted(set(starts))[:chunks]
    times = plan.run_times(epoch)
    return [(firsts.index(a), plan.runs[k][0], times[k], plan.rows[k].tolist())
            for k, a in enumerate(starts) if a in firsts]


def fetch_ahead(source: Any, shard: int, *, priority: float, use_at: float, cancelled: Callable[[], bool],
                who: str, rows: list[int] | None = None) -> bool:
    """Get ``shard`` into the node cache through ``source`` (a ``ShardSource``) for a consumer that
    will ask for it soon, and release it; a cached shard costs a lookup. ``rows``: only the units
    holding those shard-local rows, into the shard's partial copy (``ShardSource.load_rows``: a part
    mix's run). ``priority``, ``use_at``, ``cancelled``: as for ``ShardSource.fetch``; ``who``: names
    the caller in debug logs. Whether fetching ahead may go on: False once no tier has free room
    for the shard (the consumers have not yet told the cache this epoch's plan, and an eviction
    decided now could throw out a shard the epoch still needs; a partial copy takes the whole
    shard's room too), when the cache did not admit it (served privately, "pass": its consumer
    would download it again), or when the fetch failed (its consumer's own fetch raises the error
    where the training loop sees it). Thread-safe."""
    cache = source.cache
    if cache.contains(source.key(shard)):
        return True
    if max(cache.room().values()) < source.manifest.shards[shard].bytes:
        log.debug("%s: no free room for shard %d; stopping", who, shard)
        return False
    try:
        if rows is None:
            handle = source.fetch(shard, priority=priority, use_at=use_at, cancelled=cancelled)
        else:
            handle = source.load_rows(shard, rows, priority=priority, use_at=use_at, cancelled=cancelled)
    except Exception as exc:  # noqa: BLE001 - the consumer's own fetch raises it to the training loop
        log.debug("%s: shard %d not fetched (%s); its consumer will", who, shard, exc)
        return False
    tier = getattr(handle, "tier", None)  # a PartHandle (rows in the partial copy) has none
    handle.release()
    if tier == "pass":
        log.debug("%s: shard %d not admitted to the cache; stopping", who, shard)
        return False
    return True


class HeadStart:
    """Fetch ``shards`` ((shard, next-use time) in reading order) into the node cache through
    ``source`` (a ``ShardSource``) on ``threads`` threads named ``name``-k (taking the shards in
    order); see the module docstring. ``rows``: where given, the shard-local rows of each entry of
    ``shards`` to load into its partial copy (a part mix's first runs, ``fetch_ahead``) instead of
    the whole shard; the source's partial-copy handles are dropped when the threads are done.
    ``start``: start the threads now; else ``start()`` does (``datacache.DataLoader`` plans the
    head start before its workers fork, so that they inherit the plans it computed, and starts
    it after)."""

    def __init__(self, source: Any, shards: Sequence[tuple[int, float]], *, name: str,
                 rows: Sequence[list[int]] | None = None, threads: int = 1, start: bool = True) -> None:
        self._source, self._shards = source, list(shards)
        self._rows = None if rows is None else list(rows)
        if self._rows is not None and len(self._rows) != len(self._shards):
            raise ValueError(f"HeadStart: {len(self._rows)} row lists for {len(self._shards)} shards")
        self.shards = [shard for shard, _ in self._shards]  # what it fetches, in order (read-only)
        self._stop = threading.Event()  # close(): cancel the downloads in flight
        self._ended = threading.Event()  # one may not go on: take no further shard
        self._lock = threading.Lock()  # guards the two counters below; no I/O under it
        self._next, self._running = 0, max(1, int(threads))
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{k}" if threads > 1 else name, daemon=True)
                         for k in range(self._running)]
        if start:
            self.start()

    def start(self) -> None:
        """Start the threads (once; a closed head start starts none). Not for use from two threads at once."""
        for t in self._threads:
            if t.ident is None and not self._stop.is_set():
                t.start()

    def _take(self) -> int | None:
        with self._lock:
            if self._next >= len(self._shards) or self._ended.is_set() or self._stop.is_set():
                return None
            self._next += 1
            return self._next - 1

    def _run(self) -> None:
        try:
            while (position := self._take()) is not None:
                shard, use_at = self._shards[position]
                rows = None if self._rows is None else self._rows[position]
                if not fetch_ahead(self._source, shard, priority=position, use_at=use_at,
                                   cancelled=self._stop.is_set, who="head start", rows=rows):
                    self._ended.set()
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last and self._rows is not None:  # this process reads none of them: let the handles go
                self._source.forget_parts()

    @property
    def done(self) -> bool:
        """Whether the thread has finished (every shard fetched, or stopped)."""
        return not any(t.is_alive() for t in self._threads)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds) for the threads to finish; whether they have."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self.done

    def close(self) -> None:
        """Stop: abandon the downloads in flight and wait for the threads. Idempotent."""
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread() and t.ident is not None:
                t.join()


LeadItem = int | tuple[int, list[int]]  # a shard, or (shard, shard-local rows): a part mix's run


class Lead:
    """Other consumers' first reads (``items``: shards, or (shard, rows) runs of a part mix), which
    a consumer's prefetch threads get into the node cache before their own loads (``Consumer``'s
    lead): ``enter()`` has the calling thread fetch the next items in order (``fetch_ahead``) while
    fewer than ``helpers`` threads do, then wait until every item is in or one may not be (the
    rest is then left to their own consumers). One helper fetches whole shards one at a time,
    each with the link to itself; a part mix's small runs take as many helpers as come, since one
    thread would leave the link idle between them. ``priority``, ``use_at``, ``cancelled``,
    ``who``: as for ``fetch_ahead``. Thread-safe; no lock is held during a fetch."""

    def __init__(self, source: Any, items: Sequence[LeadItem], *, helpers: int, priority: float, use_at: float,
                 cancelled: Callable[[], bool], who: str) -> None:
        self._source, self._items, self._helpers = source, list(items), max(1, int(helpers))
        self._args = dict(priority=priority, use_at=use_at, cancelled=cancelled, who=who)
        self._lock = threading.Lock()  # guards the three counters below
        self._next, self._fetching, self._left = 0, 0, len(self._items)
        self._done = threading.Event()  # every item is in, or one may not be, or close()
        if not self._items:
            self._done.set()

    def _take(self) -> LeadItem | None:
        with self._lock:
            if self._done.is_set() or self._next >= len(self._items) or self._fetching >= self._helpers:
                return None
            self._next += 1
            self._fetching += 1
            return self._items[self._next - 1]

    def enter(self) -> None:
        """Help fetch the items, then wait for them (see the class docstring)."""
        while (item := self._take()) is not None:
            ok = False
            try:
                shard, rows = (item, None) if isinstance(item, int) else item
                ok = fetch_ahead(self._source, shard, rows=rows, **self._args)
            finally:
                with self._lock:
                    self._fetching -= 1
                    self._left -= 1
                    if not ok or self._left == 0:
                        self._done.set()
        self._done.wait()

    def close(self) -> None:
        """Wake every waiting thread (they then see the consumer's stop). Idempotent."""
        self._done.set()
