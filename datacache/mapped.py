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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch.utils.data as tud

import readers

from ._consumer import cap_lookahead
from .cache import CacheHandle, NodeCache
from .config import CacheConfig, PrefetchConfig, RetryConfig, TransferConfig
from .eviction import ClairvoyantPolicy, Schedule
from .manifest import Manifest, load_manifest
from .prefetch import Prefetcher
from .storage import Store, open_store

__all__ = ["CachedDataset"]


class CachedDataset(tud.Dataset):
    """Map-style access to a datacache dataset through the node cache (see the module docstring)."""

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None = None,
                 cache: CacheConfig | NodeCache | None = None, transform: Callable[[dict[str, Any]], Any] | None = None,
                 prefetch: PrefetchConfig | None = None, transfer: TransferConfig | None = None,
                 retry: RetryConfig | None = None, reader_options: Mapping[str, Any] | None = None) -> None:
        self.store: Store = open_store(url, dict(storage_options or {}), transfer=transfer, retry=retry)
        self.manifest: Manifest = load_manifest(self.store)
        self.cache = cache if isinstance(cache, NodeCache) else NodeCache(cache or CacheConfig())
        self.transform = transform
        self.prefetch = prefetch or PrefetchConfig()
        self.reader_options = dict(reader_options or {})
        self.fmt = readers.get_format(self.manifest.format)
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
        index = int(index)
        if self._state is None and self._planned is not None:
            self._state = _PlanState(self, self._my_order())
        st = self._state
        sample = st.read(index) if st is not None else None
        if sample is None:
            sample = self._read_off_plan(index)
        return self.transform(sample) if self.transform else sample

    def _get(self, shard: int) -> CacheHandle:
        info = self.manifest.shards[shard]
        return self.cache.get(self.manifest.cache_key(shard),
                              lambda path: self.store.read_into(info.name, path, size=info.bytes),
                              size=info.bytes, hash=info.hash)

    def _read_off_plan(self, index: int) -> dict[str, Any]:
        shard, local = self.manifest.locate(index)
        with self._get(shard) as handle, self.fmt.open(handle.path, **self.reader_options) as reader:
            return reader.get(local)

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
        self.schedule = Schedule(times)
        if ds.cache.config.policy != "lru":
            ds.cache.set_policy(ClairvoyantPolicy(self.schedule))
        prefetch = cap_lookahead(ds.prefetch, ds.cache, m, 1)
        self.prefetcher: Prefetcher[int, CacheHandle] = Prefetcher(
            self.run_shard, ds._get, size_of=lambda s: m.shards[s].bytes, release=CacheHandle.release,
            config=prefetch, name="datacache-mapped-prefetch")
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

    def _next_run(self) -> None:
        self.run += 1
        a, b = self.run_start[self.run], self.run_start[self.run + 1]
        self.schedule.advance(a / max(len(self.order), 1))
        m = self.ds.manifest
        shard = self.run_shard[self.run]
        ids = self.order[a:b]
        local = ids - m.offsets[shard]
        with self.prefetcher.take() as handle, self.ds.fmt.open(handle.path, **self.ds.reader_options) as reader:
            lo, hi = int(local.min()), int(local.max()) + 1
            rows = list(reader.iter_range(lo, hi)) if hi - lo <= 4 * len(ids) else None
            self.decoded = {int(g): (rows[int(l) - lo] if rows is not None else reader.get(int(l)))
                            for g, l in zip(ids, local)}

    def close(self) -> None:
        self.prefetcher.close()
