"""A mixed dataset's shard path: each stream's own ``ShardSource`` behind one virtual shard list.

``MixedSource`` looks like a ``ShardSource`` to the consumer (``fetch``, ``read_runs``, ``read_rows``,
``manifest.shards`` / ``offsets`` / ``cache_key``, ``cache``): virtual shard ``v`` is shard
``real_of[v]`` of stream ``stream_of[v]`` (``datacache.mixing.plan``), fetched through that stream's
store, options and cache keys, so copies of a shard share one cache entry and the node cache
ranks every stream's shards by one plan. ``open_mixed`` opens the streams and checks them (one
clear line naming the stream for an empty stream, schemas that differ outside per_stream, a weight
that draws nothing). Thread-safe as ``ShardSource`` is.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..cache.node import CacheHandle, NodeCache
from ..config import CacheConfig, RetryConfig, TransferConfig
from ..manifest import ShardInfo
from ..read.shard_source import ShardSource, make_cache
from .plan import MixPlan
from .streams import BATCHINGS, SAMPLINGS, Stream, draw_counts

__all__ = ["MixedSource", "MixManifest", "open_mixed", "open_source"]


class MixManifest:
    """The virtual shard list as the consumer and the plan see a manifest. Immutable.
    ``num_samples``: samples per epoch (the draws' sum); ``unit_rows``: the streams' samples per
    dcz block (``Manifest.unit_rows``) where they all agree, else 0."""

    def __init__(self, sources: Sequence[ShardSource], mix: MixPlan, dataset_id: str) -> None:
        self._sources, self._mix = sources, mix
        self.shards: tuple[ShardInfo, ...] = tuple(
            sources[s].manifest.shards[j] for s, j in zip(mix.stream_of.tolist(), mix.real_of.tolist()))
        self.offsets = mix.offsets.tolist()
        self.dataset_id = dataset_id
        self.num_samples = mix.epoch_size
        self.format = "mixed"
        units = {s.manifest.unit_rows for s in sources}
        self.unit_rows = units.pop() if len(units) == 1 else 0  # the streams' samples per block, where one

    def cache_key(self, shard: int) -> str:
        return self._sources[int(self._mix.stream_of[shard])].manifest.cache_key(int(self._mix.real_of[shard]))


class MixedSource:
    """Several streams' shards as one virtual list (see the module docstring)."""

    def __init__(self, sources: Sequence[ShardSource], streams: Sequence[Stream], mix: MixPlan) -> None:
        self.sources, self.streams, self.mix = list(sources), list(streams), mix
        ident = json.dumps([[s.manifest.dataset_id for s in sources], mix.draws, mix.batching, mix.sampling])
        self.manifest = MixManifest(self.sources, mix, "mix-" + hashlib.blake2b(ident.encode(),
                                                                               digest_size=8).hexdigest())
        self.cache: NodeCache = sources[0].cache
        self.store = sources[0].store

    def _real(self, shard: int) -> tuple[ShardSource, int]:
        return self.sources[int(self.mix.stream_of[shard])], int(self.mix.real_of[shard])

    def url(self, shard: int) -> str:
        src, j = self._real(shard)
        return src.url(j)

    def key(self, shard: int) -> str:
        return self.manifest.cache_key(shard)

    @property
    def label(self) -> str:
        """The streams' URLs, for messages."""
        return " + ".join(s.url for s in self.streams)

    def fetch(self, shard: int, **kw: Any) -> CacheHandle:
        src, j = self._real(shard)
        return src.fetch(j, **kw)

    def read_runs(self, shard: int, handle: CacheHandle, lo: int, hi: int) -> list[Any]:
        src, j = self._real(shard)
        return src.read_runs(j, handle, lo, hi)

    def read_rows(self, shard: int, handle: CacheHandle, rows: Iterable[int], *, copy: bool = False) -> dict[int, Any]:
        src, j = self._real(shard)
        return src.read_rows(j, handle, rows, copy=copy)

    def check_layout(self, dp_size: int, batch_size: int | None, batching_set: bool = True) -> None:
        """``ValueError`` if the epoch cannot give every rank a batch, or (``batching_set``: at use)
        if a composed batching has no ``batch_size``."""
        mix = self.mix
        if batching_set and mix.layout_bound and batch_size is None:
            raise ValueError(f"datacache: batching={mix.batching!r} composes batches: pass batch_size to the "
                             "StreamingDataset or to datacache.DataLoader")
        if mix.epoch_size < dp_size * (batch_size or 1):
            raise ValueError(f"datacache: epoch_size={mix.epoch_size} of the streams {self.label} is smaller than "
                             f"{dp_size} ranks x batch {batch_size or 1}: every rank needs a batch; raise epoch_size "
                             "or the weights")

    def stores(self) -> list[Any]:
        return [s.store for s in self.sources]

    def close(self) -> None:
        """Close every stream's store connections. Idempotent."""
        for s in self.sources:
            s.close()


def _check_schemas(sources: Sequence[ShardSource], streams: Sequence[Stream]) -> None:
    first = sources[0].manifest.schema
    for src, st in zip(sources[1:], streams[1:]):
        schema = src.manifest.schema
        for name in sorted(set(first) | set(schema)):
            if first.get(name) != schema.get(name):
                raise ValueError(
                    f"datacache: stream {st.url}: field {name!r} is {schema.get(name) or 'missing'}, but "
                    f"{first.get(name) or 'missing'} in stream {streams[0].url}: streams mixed in one batch need "
                    "one schema; make the fields agree, or use batching='per_stream'")


def open_mixed(streams: Sequence[Stream], *, cache: CacheConfig | NodeCache | None, transfer: TransferConfig | None,
               retry: RetryConfig | None, reader_options: Mapping[str, Any] | None, epoch_size: int | None,
               batching: str, sampling: str, seed: int, shuffle: bool) -> MixedSource:
    """Open every stream (its own store, options and reader options; one node cache) and plan the
    mix; ``ValueError`` (one line naming the stream) for bad input."""
    if batching not in BATCHINGS:
        raise ValueError(f"datacache: batching={batching!r}, expected one of {', '.join(BATCHINGS)}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"datacache: sampling={sampling!r}, expected one of {', '.join(SAMPLINGS)}")
    draw_counts(streams, [1] * len(streams), epoch_size)  # the weights' checks, before any I/O
    node_cache = make_cache(cache)
    sources: list[ShardSource] = []
    try:
        for st in streams:
            sources.append(ShardSource.open(st.url, storage_options=st.storage_options, cache=node_cache,
                                            transfer=transfer, retry=retry,
                                            reader_options=st.reader_options if st.reader_options is not None
                                            else reader_options))
            if sources[-1].manifest.num_samples == 0:
                raise ValueError(f"datacache: stream {st.url}: the dataset holds no samples; drop the stream, "
                                 "or write samples to it")
        if batching != "per_stream":
            _check_schemas(sources, streams)
        draws = draw_counts(streams, [s.manifest.num_samples for s in sources], epoch_size)
        for st, d in zip(streams, draws):
            if d == 0:
                raise ValueError(f"datacache: stream {st.url}: its {st.weight_name} draws 0 of the epoch's "
                                 f"{sum(draws)} samples; raise its weight or epoch_size, or drop the stream")
    except BaseException:
        for s in sources:
            s.close()
        raise
    mix = MixPlan([[sh.samples for sh in s.manifest.shards] for s in sources], draws, batching=batching,
                  sampling=sampling, seed=seed, shuffle=shuffle)
    return MixedSource(sources, streams, mix)


def open_source(url: str | None, streams: Sequence[Stream] | None, *, storage_options: Mapping[str, Any] | None,
                 epoch_size: int | None, batching: str, sampling: str, seed: int, shuffle: bool,
                 **kw: Any) -> ShardSource | MixedSource:
    """One dataset's ``ShardSource`` (``url``), or the streams' ``MixedSource``."""
    if (url is None) == (streams is None):
        raise ValueError("datacache: pass a dataset url, or streams=[datacache.Stream(url, ...), ...], not "
                         f"{'both' if url is not None else 'neither'}")
    if streams is None:
        if epoch_size is not None or batching != "random" or sampling != "balanced":
            raise ValueError(f"datacache: {url}: epoch_size, batching and sampling mix streams: pass "
                             f"streams=[datacache.Stream({url!r})] to use them")
        return ShardSource.open(url, storage_options=storage_options, **kw)  # type: ignore[arg-type]
    if storage_options is not None:
        raise ValueError("datacache: with streams=, give each Stream its own storage_options")
    return open_mixed(list(streams), epoch_size=epoch_size, batching=batching, sampling=sampling, seed=seed,
                      shuffle=shuffle, **kw)
