"""One consumer's epoch: plan -> prefetched, pinned shards -> samples. Used by the datasets.

A ``Consumer`` belongs to one process (the main process, or one DataLoader worker) and one epoch.
It installs the node's clairvoyant schedule in the cache, starts a ``Prefetcher`` over its shard
sequence, and yields samples window by window: the shards of a window are pinned, read
sequentially (each block decompressed once), then yielded in the plan's shuffled order. Not
thread-safe: one consumer per iterating thread.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

import readers

from .cache import CacheHandle, NodeCache
from .config import PrefetchConfig
from .errors import ReaderError
from .eviction import ClairvoyantPolicy, Schedule
from .manifest import Manifest
from .plan import ConsumerPlan, PlanSpec, build_plan
from .prefetch import Prefetcher
from .storage import Store

__all__ = ["Consumer", "node_schedule"]

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
        self.windows = [self._trim(w, skip) for w in plan.windows if w[1] > skip]
        items = [s for _, _, shards in self.windows for s in shards]
        # Stage 1: shards into the cache, far ahead (network-bound, adaptive, byte-bounded).
        self.prefetcher: Prefetcher[int, CacheHandle] = Prefetcher(
            items, self._load, size_of=lambda s: manifest.shards[s].bytes, release=CacheHandle.release,
            config=prefetch, name=name)
        # Stage 2: the next window decoded while the current one is consumed (one window ahead).
        self.decoder: Prefetcher[int, _Window] = Prefetcher(
            range(len(self.windows)), self._decode, release=_Window.release, config=_DECODE_AHEAD,
            name=f"{name}-decode")
        self.consumed = skip
        self.skipped_shards = 0

    def _trim(self, window: tuple[int, int, list[int]], skip: int) -> tuple[int, int, list[int]]:
        """A window resumed at ``skip``: only the shards that still have samples to read."""
        a, b, shards = window
        if a >= skip or self.plan.samples is None:
            return window
        ids = self.plan.samples[skip:b]
        need = set((np.searchsorted(self.manifest.offsets, ids, side="right") - 1).tolist())
        return skip, b, [s for s in shards if s in need]

    def _load(self, shard: int) -> CacheHandle:
        info = self.manifest.shards[shard]
        return self.cache.get(self.manifest.cache_key(shard),
                              lambda path: self.store.read_into(info.name, path, size=info.bytes),
                              size=info.bytes, hash=info.hash)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for a, _, _ in self.windows:
                if self.schedule is not None:
                    self.schedule.advance(self.epoch + a / max(len(self.plan), 1))
                window = self.decoder.take()
                try:
                    for s, i in zip(window.shard_of, window.local):
                        samples = window.decoded[s]
                        self.consumed += 1
                        if samples is not None:
                            yield samples[i]
                finally:
                    window.release()
        finally:
            self.close()

    def _decode(self, wi: int) -> "_Window":
        """Runs on the decode thread: pin the window's shards (waiting on stage 1) and read them."""
        assert self.plan.samples is not None
        a, b, shards = self.windows[wi]
        handles: list[CacheHandle] = []
        try:
            for _ in shards:
                handles.append(self.prefetcher.take())
            ids = self.plan.samples[max(a, self.skip):b]
            shard_of = np.searchsorted(self.manifest.offsets, ids, side="right") - 1
            local = ids - np.asarray(self.manifest.offsets)[shard_of]
            decoded = {s: self._read(s, h, local[shard_of == s]) for s, h in zip(shards, handles)}
        except BaseException:
            for h in handles:
                h.release()
            raise
        return _Window(handles, shard_of.tolist(), local.tolist(), decoded)

    def _read(self, shard: int, handle: CacheHandle, wanted: np.ndarray) -> dict[int, Any] | None:
        lo, hi = int(wanted.min()), int(wanted.max()) + 1
        url = self.store.url_of(self.manifest.shards[shard].name)
        try:
            with self.fmt.open(handle.path, **self.reader_options) as reader:
                return dict(zip(range(lo, hi), reader.iter_range(lo, hi)))
        except (readers.ReaderError, ValueError, OSError) as exc:
            err = ReaderError(f"cannot read shard as {self.manifest.format!r}: {exc}", url=url,
                              hint="Check the manifest's format, or rebuild the shard")
            if self.on_error != "skip":
                raise err from exc
            self.skipped_shards += 1
            self.cache.index.count(skipped_shards=1)
            warnings.warn(f"datacache: skipping shard: {err}", stacklevel=2)
            return None

    @property
    def wait_seconds(self) -> float:
        """Seconds the consumer waited for data (network and decoding) in this epoch."""
        return self.decoder.wait_seconds

    def close(self) -> None:
        self.decoder.close()
        self.prefetcher.close()


_DECODE_AHEAD = PrefetchConfig(threads=1, max_threads=1, lookahead_bytes=1, max_lookahead_bytes=1, adaptive=False)


class _Window:
    """A decoded window: pinned handles, read order (shard, local index) and decoded samples."""

    def __init__(self, handles: list[CacheHandle], shard_of: list[int], local: list[int],
                 decoded: dict[int, dict[int, Any] | None]) -> None:
        self.handles, self.shard_of, self.local, self.decoded = handles, shard_of, local, decoded

    def release(self) -> None:
        for h in self.handles:
            h.release()
        self.handles = []


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Collate samples into a batch: numbers and equal-shape arrays become tensors, the rest lists."""
    import torch

    out: dict[str, Any] = {}
    for k in samples[0]:
        vals = [s[k] for s in samples]
        v0 = vals[0]
        if isinstance(v0, (bool, int)) and not isinstance(v0, bool):
            out[k] = torch.tensor(vals, dtype=torch.int64)
        elif isinstance(v0, float):
            out[k] = torch.tensor(vals, dtype=torch.float64)
        elif isinstance(v0, np.ndarray) and all(isinstance(v, np.ndarray) and v.shape == v0.shape for v in vals):
            out[k] = torch.from_numpy(np.stack(vals))
        else:
            out[k] = vals
    return out

