"""``CachedDataset``: a map-style dataset for users with their own sampler.

Give it the future index order up front with ``plan(indices)`` and the same machinery as
``StreamingDataset`` serves it: a prefetcher walks the shard runs of that order ahead of the reads,
and the node cache evicts clairvoyantly. Reads that follow the plan come from decoded runs; a read
off the plan still works (one cache ``get`` and one reader lookup), it is just not prefetched.

With ``DataLoader(num_workers=W)``, pass the loader's ``batch_size`` to ``plan``: the default
sampler dispatch sends batch ``k`` to worker ``k % W``, and each worker prefetches its own batches.
One instance per process; ``__getitem__`` is called by one thread at a time.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch.utils.data as tud

from ..cache.eviction import Schedule
from ..cache.node import CacheHandle, NodeCache
from ..config import CacheConfig, PeerConfig, PrefetchConfig, RetryConfig, TransferConfig
from ..dist import detect
from ..manifest import Manifest
from ..read.node_schedule import cap_lookahead
from ..read.peers import attach
from ..read.prefetch import Prefetcher
from ..read.shard_source import ShardSource, tell_plan
from ..store.storage import Store

__all__ = ["CachedDataset"]


class CachedDataset(tud.Dataset):
    """Map-style access to a datacache dataset through the node cache (see the module docstring)."""

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None = None,
                 cache: CacheConfig | NodeCache | None = None, transform: Callable[[dict[str, Any]], Any] | None = None,
                 prefetch: PrefetchConfig | None = None, transfer: TransferConfig | None = None,
                 retry: RetryConfig | None = None, reader_options: Mapping[str, Any] | None = None,
                 peers: PeerConfig | None = None) -> None:
        """``url``, ``storage_options``, ``transfer``, ``retry``: the dataset and how to reach it (as
        for ``StreamingDataset``); ``cache``: a ``CacheConfig`` or an open ``NodeCache`` to share;
        ``transform``: applied to each sample; ``prefetch``: the prefetch pool's config;
        ``reader_options``: keyword arguments for the format's reader; ``peers``: the peer tier
        (``datacache.PeerConfig``, as for ``StreamingDataset``; shards owned by rendezvous hashing,
        the sampler's order being this process's own)."""
        self.source = ShardSource.open(url, storage_options=storage_options, cache=cache, transfer=transfer,
                                       retry=retry, reader_options=reader_options)
        self._peers = attach([self.source], peers, detect())
        self.store: Store = self.source.store
        self.manifest: Manifest = self.source.manifest
        self.cache: NodeCache = self.source.cache
        self.transform = transform
        self.prefetch = prefetch or PrefetchConfig()
        self._planned: np.ndarray | None = None
        self._batch_size: int | None = None
        self._state: _PlanState | None = None

    def __len__(self) -> int:
        return self.manifest.num_samples

    def plan(self, indices: Sequence[int], *, batch_size: int | None = None) -> None:
        """Announce the order of the next reads (e.g. ``list(sampler)``); replaces any earlier plan."""
        self.close()
        arr = np.asarray(indices, dtype=np.int64)
        if len(arr) and (arr.min() < 0 or arr.max() >= len(self)):
            raise IndexError(f"plan holds indices outside [0, {len(self)})")
        self._planned, self._batch_size = arr, batch_size

    def _my_order(self) -> np.ndarray:
        assert self._planned is not None
        info = tud.get_worker_info()
        if info is None or info.num_workers <= 1:
            return self._planned
        bs = self._batch_size or 1
        batch_of = np.arange(len(self._planned)) // bs
        return self._planned[batch_of % info.num_workers == info.id]

    def __getitem__(self, index: int) -> Any:
        """Sample ``index``; negative indices count from the end, as in a sequence (``IndexError``
        out of range, which also ends a ``for`` loop over the dataset)."""
        n, index = len(self), operator.index(index)
        if not -n <= index < n:
            raise IndexError(f"datacache: index {index} out of range for {self.store.url}, which holds {n} samples")
        index %= n
        if self._state is None and self._planned is not None:
            self._state = _PlanState(self, self._my_order())
        st = self._state
        sample = st.read(index) if st is not None else None
        if sample is None:
            sample = self._read_off_plan(index)
        return self.transform(sample) if self.transform else sample

    def _read_off_plan(self, index: int) -> dict[str, Any]:
        shard, local = self.manifest.locate(index)
        with self.source.fetch(shard) as handle:
            return self.source.read_rows(shard, handle, [local])[local]

    def close(self) -> None:
        """Stop prefetching. Idempotent."""
        if self._state is not None:
            self._state.close()
            self._state = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_state"] = None
        return state


class _PlanState:
    """A planned order: its shard runs, the prefetcher over them, and the current decoded run."""

    def __init__(self, ds: CachedDataset, order: np.ndarray) -> None:
        m = ds.manifest
        self.ds, self.order, self.pos = ds, order, 0
        shard_of = np.searchsorted(m.offsets, order, side="right") - 1
        starts = np.flatnonzero(np.concatenate([[True], shard_of[1:] != shard_of[:-1]])) if len(order) else []
        self.run_start = list(starts) + [len(order)]
        self.run_shard = shard_of[starts].tolist() if len(order) else []
        self.shard_of = shard_of
        n = max(len(order), 1)
        times: dict[str, list[float]] = {}
        for s, a in zip(self.run_shard, self.run_start):
            times.setdefault(m.cache_key(s), []).append(a / n)
        self.schedule = tell_plan(ds.cache, Schedule(times))
        prefetch = cap_lookahead(ds.prefetch, ds.cache, m, 1)
        self.prefetcher: Prefetcher[int, CacheHandle] = Prefetcher(
            list(enumerate(self.run_shard)), self._fetch, size_of=lambda item: m.shards[item[1]].bytes,
            release=CacheHandle.release, config=prefetch, name="datacache-mapped-prefetch")
        self.run = -1
        self.decoded: dict[int, Any] = {}

    def read(self, index: int) -> dict[str, Any] | None:
        """The sample if ``index`` is the next planned read, else None (off plan)."""
        if self.pos >= len(self.order) or int(self.order[self.pos]) != index:
            return None
        while self.run + 1 < len(self.run_start) - 1 and self.pos >= self.run_start[self.run + 1]:
            self._next_run()
        self.pos += 1
        return self.decoded[index]

    def _time(self, run: int) -> float:
        return self.run_start[run] / max(len(self.order), 1)

    def _fetch(self, item: tuple[int, int]) -> CacheHandle:
        run, shard = item
        return self.ds.source.fetch(shard, priority=run, use_at=self._time(run))

    def _next_run(self) -> None:
        self.run += 1
        a, b = self.run_start[self.run], self.run_start[self.run + 1]
        if self.schedule is not None:
            self.schedule.advance(self._time(self.run))
        shard = self.run_shard[self.run]
        ids = self.order[a:b]
        local = ids - self.ds.manifest.offsets[shard]
        with self.prefetcher.take() as handle:
            rows = self.ds.source.read_rows(shard, handle, local.tolist())
        self.decoded = {int(g): rows[int(row)] for g, row in zip(ids, local)}

    def close(self) -> None:
        self.prefetcher.close()
