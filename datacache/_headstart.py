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
Thread-safe: the thread is the object's only user besides ``close()``.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["HeadStart", "RUNS_PER_WORKER", "fetch_ahead"]

log = logging.getLogger("datacache.dataset")

RUNS_PER_WORKER = 2  # the first two runs: a worker's first step needs its first run, the next its second


def fetch_ahead(source: Any, shard: int, *, priority: float, use_at: float, cancelled: Callable[[], bool],
                who: str) -> bool:
    """Get ``shard`` into the node cache through ``source`` (a ``ShardSource``) for a consumer that
    will ask for it soon, and release it; a cached shard costs a lookup. ``priority``, ``use_at``,
    ``cancelled``: as for ``ShardSource.fetch``; ``who``: names the caller in debug logs. Whether
    fetching ahead may go on: False once no tier has free room for the shard (the consumers have
    not yet told the cache this epoch's plan, and an eviction decided now could throw out a shard
    the epoch still needs), when the cache did not admit it (served privately, "pass": its consumer
    would download it again), or when the fetch failed (its consumer's own fetch raises the error
    where the training loop sees it). Thread-safe."""
    cache = source.cache
    if cache.contains(source.key(shard)):
        return True
    if max(cache.room().values()) < source.manifest.shards[shard].bytes:
        log.debug("%s: no free room for shard %d; stopping", who, shard)
        return False
    try:
        handle = source.fetch(shard, priority=priority, use_at=use_at, cancelled=cancelled)
    except Exception as exc:  # noqa: BLE001 - the consumer's own fetch raises it to the training loop
        log.debug("%s: shard %d not fetched (%s); its consumer will", who, shard, exc)
        return False
    tier = handle.tier
    handle.release()
    if tier == "pass":
        log.debug("%s: shard %d not admitted to the cache; stopping", who, shard)
        return False
    return True


class HeadStart:
    """Fetch ``shards`` ((shard, next-use time) in reading order) into the node cache through
    ``source`` (a ``ShardSource``) on a thread named ``name``; see the module docstring."""

    def __init__(self, source: Any, shards: Sequence[tuple[int, float]], *, name: str) -> None:
        self._source, self._shards = source, list(shards)
        self.shards = [shard for shard, _ in self._shards]  # what it fetches, in order (read-only)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for position, (shard, use_at) in enumerate(self._shards):
            if self._stop.is_set() or not fetch_ahead(self._source, shard, priority=position, use_at=use_at,
                                                      cancelled=self._stop.is_set, who="head start"):
                return

    @property
    def done(self) -> bool:
        """Whether the thread has finished (every shard fetched, or stopped)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds) for the thread to finish; whether it has."""
        self._thread.join(timeout)
        return self.done

    def close(self) -> None:
        """Stop: abandon the download in flight and wait for the thread. Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

