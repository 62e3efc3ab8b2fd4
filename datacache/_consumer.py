"""One consumer's epoch: plan -> prefetched, pinned shards -> samples. Used by the datasets.

A ``Consumer`` belongs to one process (the main process, or one DataLoader worker) and one epoch.
It installs the node's clairvoyant schedule in the cache and runs a two-stage pipeline over its
runs: stage 1 (``Prefetcher``, adaptive thread pool) gets each run's shard into the cache far
ahead; stage 2 (one decode thread) takes the next runs' pinned shards, reads their ranges sequentially
(each block decompressed once) and unpins them. The consumer then walks the plan's steps, yielding samples in the
shuffled order while at most ``window`` runs are open. Not thread-safe: one consumer per thread.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

import readers

from ._openshards import open_shards
from .cache import CacheHandle, NodeCache
from .config import PrefetchConfig
from .errors import IntegrityError, NotFoundError, ReaderError
from .eviction import ClairvoyantPolicy, Schedule
from .manifest import Manifest
from .plan import ConsumerPlan, PlanSpec, build_plan
from .prefetch import Prefetcher
from .storage import Store

__all__ = ["Consumer", "node_schedule", "cap_lookahead"]

log = logging.getLogger("datacache.dataset")


def node_schedule(manifest: Manifest, counts: np.ndarray, spec: PlanSpec, dp_ranks: list[int],
                  first_plan_order: np.ndarray | None = None) -> Schedule:
    """Next-use times of every shard for every consumer on this node, for this epoch and the next."""
    times: dict[str, list[float]] = {}
    for epoch in (spec.epoch, spec.epoch + 1):
        for r in dp_ranks:
            for w in range(spec.num_workers):
                sub = PlanSpec(**{**spec.__dict__, "epoch": epoch, "dp_rank": r, "worker_id": w})
                order = first_plan_order if epoch == spec.epoch else None
                plan = build_plan(counts, sub, order=order, shards_only=True)
                for shard, t in plan.shard_times(epoch):
                    times.setdefault(manifest.cache_key(shard), []).append(t)
    return Schedule(times)


def cap_lookahead(prefetch: PrefetchConfig, cache: NodeCache, manifest: Manifest, consumers: int) -> PrefetchConfig:
    """Cap the lookahead so the node's consumers pin at most a quarter of the fastest tier:
    pinned entries cannot be evicted, and a cache full of pins serves nothing twice."""
    tier = next((t for t in (cache.ram, cache.ssd) if t.enabled), None)
    if tier is None:
        return prefetch
    biggest = max((s.bytes for s in manifest.shards), default=1)
    cap = max(tier.budget // (4 * max(consumers, 1)), biggest)
    la = min(int(prefetch.lookahead_bytes), cap)
    return dataclasses.replace(prefetch, lookahead_bytes=la,
                               max_lookahead_bytes=max(la, min(int(prefetch.max_lookahead_bytes), cap)))


class Consumer:
    """Iterates one consumer's plan for one epoch (see module docstring)."""

    def __init__(self, *, manifest: Manifest, store: Store, cache: NodeCache, plan: ConsumerPlan, epoch: int,
                 skip: int, prefetch: PrefetchConfig, schedule: Schedule | None, reader_options: dict[str, Any],
                 on_error: str, name: str) -> None:
        self.manifest, self.store, self.cache, self.plan = manifest, store, cache, plan
        self.epoch, self.skip = epoch, skip
        self.reader_options, self.on_error = reader_options, on_error
        self.fmt = readers.get_format(manifest.format)
        self.schedule = schedule
        if schedule is not None:
            cache.set_policy(ClairvoyantPolicy(schedule))
        n_runs = len(plan.runs)
        # Runs that still have samples to read (all of them unless resuming mid-epoch).
        self.needed = sorted(set(plan.run_of[skip:].tolist())) if skip and plan.run_of is not None \
            else list(range(n_runs))
        self.run_times = plan.run_times(epoch)  # set before the stages start: their threads read it
        self.skipped_shards = 0  # set before the stages start: the decode thread counts into it
        self._skipped: set[int] = set()
        # Stage 1: shards into the cache, far ahead (network-bound, adaptive, byte-bounded).
        self.prefetcher: Prefetcher[tuple[int, int], CacheHandle] = Prefetcher(
            list(enumerate(plan.runs[r][0] for r in self.needed)), self._load,
            size_of=lambda item: manifest.shards[item[1]].bytes, release=CacheHandle.release, config=prefetch,
            name=name)
        # Stage 2: the next runs decoded while the current step is consumed.
        self.decoder: Prefetcher[int, _Run] = Prefetcher(
            self.needed, self._decode, release=_Run.release, config=_DECODE_AHEAD, name=f"{name}-decode")
        self.consumed = skip

    def _load(self, item: tuple[int, int]) -> CacheHandle:
        """Get (position in the plan, shard) into the cache; earlier positions get the link first."""
        position, shard = item
        info = self.manifest.shards[shard]
        try:
            return self.cache.get(self.manifest.cache_key(shard),
                                  lambda path: self.store.read_into(info.name, path, size=info.bytes,
                                                                    priority=position),
                                  size=info.bytes, hash=info.hash, use_at=self.run_times[self.needed[position]])
        except IntegrityError as exc:
            if exc.url is not None:
                raise
            err = IntegrityError(str(exc), url=self.store.url_of(info.name))  # the cache knows keys, not URLs
            err.hint = exc.hint
            raise err from exc

    def _decode(self, run: int) -> "_Run":
        """Runs on the decode thread: pin the run's shard (waiting on stage 1) and read its range."""
        shard, lo, hi = self.plan.runs[run]
        if self.schedule is not None:  # the shard file is read now: for the cache, this is its use
            self.schedule.advance(self.run_times[run])
        try:
            handle = self.prefetcher.take()
        except (IntegrityError, NotFoundError) as exc:  # this shard's object is missing or not the manifest's
            if self.on_error != "skip":
                raise
            self._skip(shard, exc)
            return _Run(lo, None)
        try:
            return _Run(lo, self._read(shard, handle, lo, hi))
        finally:
            # Decoded samples own their memory, so the shard is unpinned at once: pins stay within
            # the prefetch lookahead and the cache keeps its freedom to evict.
            handle.release()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        plan = self.plan
        assert plan.samples is not None and plan.run_of is not None
        shards = np.array([r[0] for r in plan.runs] or [0], dtype=np.int64)
        los = np.array([r[1] for r in plan.runs] or [0], dtype=np.int64)
        run_of = plan.run_of.tolist()
        index = (plan.samples - np.asarray(self.manifest.offsets)[shards[plan.run_of]] - los[plan.run_of]).tolist()
        needed = set(self.needed)
        open_runs: dict[int, _Run] = {}
        steps = plan.steps.tolist()
        try:
            for i in range(len(steps) - 1):
                if i in needed:
                    open_runs[i] = self.decoder.take()
                for p in range(max(steps[i], self.skip), steps[i + 1]):
                    samples = open_runs[run_of[p]].samples
                    self.consumed = p + 1
                    if samples is not None:
                        yield samples[index[p]]
                done = open_runs.pop(i - plan.window + 1, None)
                if done is not None:
                    done.release()
        finally:
            for r in open_runs.values():
                r.release()
            self.close()

    def _read(self, shard: int, handle: CacheHandle, lo: int, hi: int) -> list[Any] | None:
        url = self.store.url_of(self.manifest.shards[shard].name)
        shards = open_shards()
        try:
            reader = shards.checkout(self.fmt, handle.path, self.reader_options)
            try:
                samples = list(reader.iter_range(lo, hi))
            except BaseException:
                reader.close()
                raise
            shards.checkin(self.fmt, handle.path, reader, self.reader_options)
            return samples
        except (readers.ReaderError, ValueError, OSError) as exc:
            err = ReaderError(f"cannot read shard as {self.manifest.format!r}: {exc}", url=url,
                              hint="Check the manifest's format, or rebuild the shard")
            if self.on_error != "skip":
                raise err from exc
            self._skip(shard, err)
            return None

    def _skip(self, shard: int, err: BaseException) -> None:
        """on_error="skip": count the shard (``stats()["skipped_shards"]``) and warn, once per shard."""
        if shard in self._skipped:
            return
        self._skipped.add(shard)
        self.skipped_shards += 1
        self.cache.index.count(skipped_shards=1)
        warnings.warn(f"datacache: skipping shard: {err}", stacklevel=3)

    @property
    def wait_seconds(self) -> float:
        """Seconds the consumer waited for data (network and decoding) in this epoch."""
        return self.decoder.wait_seconds

    def close(self) -> None:
        self.decoder.close()
        self.prefetcher.close()


_DECODE_AHEAD = PrefetchConfig(threads=1, max_threads=1, lookahead_bytes=2, max_lookahead_bytes=2, adaptive=False)


class _Run:
    """A decoded run: its first local index and samples (None if the shard was skipped)."""

    def __init__(self, lo: int, samples: list[Any] | None) -> None:
        self.lo, self.samples = lo, samples

    def release(self) -> None:
        self.samples = None
