"""The drop-in PyTorch datasets: ``StreamingDataset`` (iterable) and ``CachedDataset`` (map-style).

``StreamingDataset`` works with a plain ``DataLoader`` (any ``num_workers``, ``persistent_workers``,
``pin_memory``) and torchdata's ``StatefulDataLoader``. Each consumer (the main process or each
DataLoader worker) computes its plan for the epoch (``datacache.plan.epoch``), tells the node cache the
future reads of every consumer on the node (clairvoyant eviction), and prefetches its next shards
into the RAM tier with an adaptive thread pool while it yields samples.

Resume: ``state_dict()`` records the epoch and how many samples each worker has delivered;
``load_state_dict()`` continues exactly there (it also takes a ``StatefulDataLoader``'s state).
With the same data-parallel size and worker count the order is exactly the one that would have
come; with another world size or worker count the samples not yet delivered are split among the
new consumers and each is read exactly once. The rules are in ``datacache.plan.resume``.

A dataset object is used by one iterating thread per process; ``stats()`` and ``set_epoch()`` may
be called from the training loop.

Checkpoints and the loader's questions: ``state_dict``/``load_state_dict``, and what
``datacache.DataLoader`` asks before its workers start (``worker_rounds``, ``head_start``,
``resume_started``). The rules of a resume are in ``datacache.plan.resume``.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from types import FrameType
from typing import Any

import numpy as np
import numpy.ma  # noqa: F401 - the plan's np.unique imports it on first use: once here, not per forked worker
import numpy.random  # noqa: F401 - the same (each import costs a starting DataLoader worker 40 ms of CPU)
import torch.utils.data as tud

from ..cache.node import NodeCache
from ..config import CacheConfig, PeerConfig, PrefetchConfig, RetryConfig, TransferConfig, parse_size
from ..dist import DistInfo, detect, plan_nodes
from ..manifest import Manifest
from ..mixing.source import MixedSource, open_source
from ..mixing.streams import Stream
from ..plan.epoch import ConsumerPlan, PlanSpec, build_plan, first_shards, mixed_share
from ..plan.node_assign import assign_nodes
from ..plan.node_share import readonly
from ..plan.part_shuffle import part_chunk
from ..plan.resume import (
    ResumeState,
    common_state,
    plan_mix,
    rank_state,
    resume_plan,
    resume_spec,
    start_state,
)
from ..read.consumer import Consumer, SkipMarks
from ..read.headstart import RUNS_PER_WORKER, HeadStart, LeadItem, first_chunks
from ..read.lifecycle import die_with_parent
from ..read.node_schedule import (
    NODE_SHUFFLE,
    cap_lookahead,
    key_datasets,
    mix_fields,
    node_dp_ranks,
    node_schedule,
    sliding_window,
    worth_sharing,
)
from ..read.peers import attach, owned_keys, peer_stats, with_cluster_times
from ..read.shard_source import ShardSource, tell_plan
from ..store.storage import Store
from . import crossread
from .batches import RING_SLOTS, RingCollator, batched, collate, sharing
from .bundles import bundled
from .gather import Gatherer, gathered
from .next_plan import NextEpoch, expected_spec
from .rounds import Rounds, WorkerBatches
from .shared import STORE_FIELDS, AutoEpochs, OwnStats, main_token, shared_int, worker_token
from .tiermap import TierMapper
from .torch_compat import loader_batch

__all__ = ["StreamingDataset"]

log = logging.getLogger("datacache.pytorch")
_IN_PLACE_GROWTH = 16  # a node mix's chunk, at most this many times its size when its rows are read in place


class StreamingDataset(tud.IterableDataset):
    """Stream a datacache dataset through the node cache (see the module docstring).

    Arguments (all but ``url`` keyword-only):

    - ``url``: the dataset's prefix (any fsspec URL holding a ``manifest.json``); or
    - ``streams``: several datasets mixed into one (``datacache.Stream``, each with its own options
      and at most one of proportion/repeat/choose; see ``datacache.mixing.streams``), with
      ``epoch_size`` (samples per epoch; default: the streams' sizes summed, or their
      repeat/choose draws), ``batching`` ("random": mixed; "stratified": every batch holds each
      stream's share within one sample; "per_stream": each batch from one stream, which allows
      different schemas) and ``sampling`` ("balanced": a stream drawn below its size takes a new
      subset each epoch; "fixed": the same one). Each epoch draws exactly the streams' counts.
    - ``storage_options``: fsspec options for the store (credentials, ``client_kwargs``...).
    - ``cache``: a ``CacheConfig`` (default ``CacheConfig()``, from ``DATACACHE_*`` variables and
      defaults) or an open ``NodeCache`` to share with other datasets.
    - ``shuffle``, ``seed``: the seeded shard and sample shuffle; the same ``seed`` on every rank.
      ``shuffle=False``: each rank's part (a contiguous stretch) in the written order, also through
      DataLoader workers, which are dealt its batches in turn, as torch takes them (plan step 3).
    - ``drop_last``: drop the samples that do not divide evenly among ranks, instead of padding.
    - ``window``: shard runs a sample may move across in the sliding-window shuffle (a cold
      epoch's, or one whose node share does not fit in the cache). Default: 4, fewer (down to 1)
      where the node's consumers (ranks x workers) would hold more decoded shards than the RAM
      tier's budget (``nodeplan.sliding_window``).
    - ``node_shuffle``: "auto" (default): from epoch 1 on, when the node's share of the dataset
      fits in the node cache (at most 0.9 of its budget), each epoch is one uniform permutation of
      the node's share across all its ranks and workers (a global shuffle's quality within the
      node; ``datacache.plan.node_shuffle``), and epoch 0 too when the share is already cached (a cache
      warmed with ``datacache warm``); a cold epoch 0 whose share will fit is read as a part mix
      (``datacache.plan.part_shuffle``: parts of every shard at once by ranged reads, each batch from many
      shards; dcz datasets on one node; elsewhere the sliding window). "window": as "auto", but a
      cold epoch 0 through the sliding window (its first batch after one shard, its batches from
      a few shards); "parts": the same as "auto"; "always": every epoch a node mix, the first too
      (on a cold cache the first batch then waits for about one batch's shards); "never": the
      sliding window only. ``shuffle_chunk``: bytes a node-mixed consumer reads per
      chunk (default: the RAM tier's budget over 8 x the node's consumers, within 1 to 64 MB, up
      to 16 x larger where the shards' blocks are raw: ``_in_place_chunk``).
    - ``transform``: applied to each sample (in the consumer's process) before it is yielded.
    - ``batch_size``: when set, yields collated batches (``collate_fn``, default: what
      ``default_collate`` makes, with tensors, arrays and numbers written once into a
      shared-memory ring; tensors or arrays of differing shapes stay lists) straight from the
      reader; use ``DataLoader(ds, batch_size=None)`` (a DataLoader that batches again is
      refused). A rank's batches are dealt whole to the DataLoader workers, so ``len()`` batches
      come whatever ``num_workers`` is; with ``drop_last`` every batch is full.
    - ``collate_fn``: how batched mode collates a list of samples.
    - ``bytes_views``: in batched mode with the default collation, each ``bytes`` or ``str``
      field of a batch comes as one ``datacache.pytorch.collate.PackedBytes`` (zero-copy views of
      the batch's shared memory: its ``data`` buffer and ``offsets``, ``p[i]``, ``p.tensor(i)``)
      rather than default_collate's list of ``bytes`` or ``str`` (built with one copy).
    - ``replication=k``: the k consecutive ranks of a tensor/pipeline-parallel group receive
      identical samples; or pass ``dp_rank`` and ``dp_size`` (both) explicitly.
    - ``prefetch``, ``transfer``, ``retry``: the prefetch pool, the store's transfers and its
      retries (``PrefetchConfig``, ``TransferConfig``, ``RetryConfig``).
    - ``reader_options``: keyword arguments for the format's reader.
    - ``on_error="skip"`` skips a shard that cannot be read (its object missing or not matching
      the manifest, or unparsable by the reader) instead of raising: one warning per shard and
      epoch on the node (whichever of its consumers, ranks and DataLoader workers, skips it first),
      counted once in ``stats()["skipped_shards"]``; the other shards' samples are delivered.
      Default "raise".
    - ``dist``: where this process sits (rank, world and node sizes); default: detected from
      ``torch.distributed`` or the launcher's variables (``datacache.dist.detect``).
    - ``placement``: "node" (default) keeps each shard on one node for the whole run when the job
      has several nodes (each epoch reshuffles within a node's share, so a node's cache keeps
      serving); "global" reshuffles all shards over all ranks every epoch. One node: the same.
    - ``peers``: the peer tier (``datacache.PeerConfig``; default from ``DATACACHE_PEERS`` and
      ``DATACACHE_PEER_TOKEN``, off when no peers are set): the job's nodes serve their cached
      shards to each other, and the store answers only what no node holds (docs/peers.md).
    """

    def __init__(self, url: str | None = None, *, streams: Sequence[Stream] | None = None,
                 epoch_size: int | None = None, batching: str = "random", sampling: str = "balanced",
                 storage_options: Mapping[str, Any] | None = None,
                 cache: CacheConfig | NodeCache | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, window: int | None = None,
                 transform: Callable[[dict[str, Any]], Any] | None = None, batch_size: int | None = None,
                 collate_fn: Callable[[list[dict[str, Any]]], Any] = collate, replication: int = 1,
                 dp_rank: int | None = None, dp_size: int | None = None, prefetch: PrefetchConfig | None = None,
                 transfer: TransferConfig | None = None, retry: RetryConfig | None = None,
                 reader_options: Mapping[str, Any] | None = None, on_error: str = "raise",
                 dist: DistInfo | None = None, placement: str = "node", node_shuffle: str = "auto",
                 shuffle_chunk: int | str | None = None, bytes_views: bool = False,
                 peers: PeerConfig | None = None) -> None:
        super().__init__()
        if on_error not in ("raise", "skip"):
            raise ValueError("on_error must be 'raise' or 'skip'")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int or None (samples mode), got {batch_size!r}")
        self.source = open_source(url, streams, storage_options=storage_options, cache=cache, transfer=transfer,
                                   retry=retry, reader_options=reader_options, epoch_size=epoch_size,
                                   batching=batching, sampling=sampling, seed=seed, shuffle=shuffle)
        self._mix = self.source.mix if isinstance(self.source, MixedSource) else None
        self.store: Store = self.source.store
        self.manifest: Manifest = self.source.manifest
        self.cache: NodeCache = self.source.cache
        self.counts = readonly([s.samples for s in self.manifest.shards])  # the plan hashes it once
        self.shuffle, self.seed, self.drop_last, self.window = shuffle, seed, drop_last, window
        self.node_shuffle, self.shuffle_chunk = node_shuffle, parse_size(shuffle_chunk)
        self._key_datasets = key_datasets(self.manifest)
        self.cache.reading(self, self._key_datasets)
        if node_shuffle not in NODE_SHUFFLE:
            raise ValueError(f"node_shuffle={node_shuffle!r}: expected one of {', '.join(NODE_SHUFFLE)}")
        self.transform, self.batch_size, self.collate_fn = transform, batch_size, collate_fn
        self.bytes_views = bytes_views
        self._pin = False  # set by datacache.DataLoader(pin_memory=True): the training process pins the rings
        # set by datacache.DataLoader while it forks its workers, which send bundles (datacache.pytorch.bundles)
        self._bundle, self._ring_slots = 0, RING_SLOTS
        self._loader_batched = False  # batch_size set by datacache.DataLoader: len() stays the sample count
        self.prefetch = prefetch or PrefetchConfig()
        self.on_error = on_error
        # one report per shard and epoch
        self._skips = SkipMarks(self.cache.control_dir) if on_error == "skip" else None
        self._own = OwnStats()  # stats()["dataset"]: this dataset's figures, over its DataLoader workers too
        self._flushed: Consumer | None = None  # the consumer whose figures were added to them last
        self.dist = dist or detect()
        if (dp_rank is None) != (dp_size is None):
            raise ValueError("pass both dp_rank and dp_size, or neither")
        self.replication = replication
        if dp_size is None:
            if self.dist.world_size % replication:
                raise ValueError(f"world size {self.dist.world_size} is not a multiple of replication={replication}")
            dp_size, dp_rank = self.dist.world_size // replication, self.dist.rank // replication
        self.dp_size, self.dp_rank = int(dp_size), int(dp_rank)
        self.placement = placement
        self.num_nodes = self._num_nodes()
        # Composed batches (a mix's stratified / per_stream) lay themselves out over the nodes.
        self._composed = self._mix is not None and self._mix.layout_bound
        if isinstance(self.source, MixedSource):
            self.source.check_layout(self.dp_size, batch_size, batching_set=False)
        self.shard_bytes = readonly([s.bytes for s in self.manifest.shards])
        if self.num_nodes > 1 and not self._composed:  # once per run and node: forked workers inherit it
            assign_nodes(self.shard_bytes, self.num_nodes, self.seed, share_dir=self.cache.control_dir)
        self._peers = attach(self._sources(), peers, self.dist, placement=self.placement if not self._composed
                             else "global", num_nodes=self.num_nodes, seed=self.seed)
        if self._peers is not None:  # the server (maybe this process's) keeps what the node owns
            tell_plan(self.cache, None, owned_keys(self._sources()))
        self._epoch = shared_int()
        self.epoch = 0
        self._epochs = AutoEpochs()  # the epochs of iterations without set_epoch (datacache.pytorch.shared)
        self._follow = False  # DataLoader workers forked now take the epoch the main process decided
        self._resume: ResumeState | None = None  # loaded, not yet iterated
        self._resume_pid = os.getpid()  # the process that loaded it (a DataLoader worker inherits the main's)
        self._resume_base: ResumeState | None = None  # what the current iteration started from
        self._in_workers = shared_int()  # 1 while DataLoader workers iterate copies of this dataset
        self._iterations = 0  # iter() calls in this process: the latest one is the live iteration
        self._consumer: Consumer | None = None
        self._inflation: float | None = None  # ``_in_place_chunk``'s probe of the cached shards, once known
        self._next_plan: NextEpoch | None = None  # a worker's guess at its next epoch (next_plan)
        self._mapper: TierMapper | None = None  # the training process's, of its last cold epoch (tiermap)
        self._plan_ahead = True  # whether workers build it: datacache.DataLoader sets persistent_workers here
        self._collator: RingCollator | None = None
        self._worker = (0, 1)
        self._turn = 1  # samples mode in a DataLoader worker: the samples torch batches from one worker at a time

    # ------------------------------------------------------------------ plan
    @property
    def epoch(self) -> int:
        """The current epoch; in shared memory, so persistent DataLoader workers see ``set_epoch``."""
        return int(self._epoch)

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch.fill_(int(value))

    @property
    def _epoch_explicit(self) -> bool:
        """``set_epoch`` was called (in any process of the rank: shared memory)."""
        return self._epochs.explicit

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (reshuffles); call before iterating, as with DistributedSampler. Once it
        is called the epochs are the caller's; never called, each new ``iter()`` reads the next
        epoch (the first: 0, or a loaded state's; ``datacache.pytorch.shared``)."""
        if self._resume is not None and self._resume.epoch != epoch:
            self._resume = None
        self.epoch = int(epoch)
        self._epochs.set_explicit()

    def start_iteration(self) -> None:
        """Decide, in the main process, the epoch of the iteration a loader's workers are about to
        begin (``datacache.DataLoader``, before it plans their rounds and forks them): the workers
        forked until ``resume_started`` take it as it is."""
        self._begin_epoch(None)
        self._follow = True

    def _begin_epoch(self, info: Any) -> None:
        """Set the epoch of the iteration this process begins (``info``: the DataLoader worker's, or
        None): the caller's after ``set_epoch``, else the next (``datacache.pytorch.shared``)."""
        if self._epoch_explicit or (info is not None and self._follow):
            return
        pending = self._resume.epoch if self._resume is not None else None
        token = main_token() if info is None else worker_token(info.seed - info.id, self._iterations)
        self.epoch = self._epochs.begin(token, 0 if info is None else 1 + info.id, self.epoch, fixed=pending,
                                        inherited=self._resume_pid != os.getpid())

    def _spec(self, num_workers: int, worker_id: int, epoch: int | None = None, mixes: bool = True) -> PlanSpec:
        """The plan spec of worker ``worker_id`` of ``num_workers``; ``mixes=False`` leaves the node
        mix out (a rank's length is the same either way)."""
        if isinstance(self.source, MixedSource):  # batch_size may have been set since (datacache.DataLoader)
            self.source.check_layout(self.dp_size, self.batch_size)
        shuffle = self.shuffle and not self._composed  # a composed order stays as it is
        consumers = len(self._node_dp_ranks()) * num_workers
        spec = PlanSpec(seed=self.seed, epoch=self.epoch if epoch is None else epoch, shuffle=shuffle,
                        window=self.window or sliding_window(self.cache.config.ram_bytes, consumers,
                                                             int(self.shard_bytes.max(initial=1))),
                        drop_last=self.drop_last, dp_size=self.dp_size, dp_rank=self.dp_rank,
                        num_workers=num_workers, worker_id=worker_id, batch_size=self.batch_size or 1,
                        num_nodes=self.num_nodes, placement=self.placement, composed=self._composed,
                        shard_bytes=self.shard_bytes, unit_rows=self.manifest.unit_rows,
                        in_turns=0 if self.shuffle else 1 if self.batch_size else self._turn)  # the written order
        if not (mixes and shuffle):
            return spec

        def share_cached(budget: int) -> bool:  # every shard of the node's share, mixed so, cached now
            share = mixed_share(self.counts, replace(spec, mix_bytes=budget, mix_from=0))
            return share is not None and self.cache.contains_all(self.manifest.cache_key(int(s)) for s in share)

        fields = mix_fields(
            self.node_shuffle, self.shuffle_chunk, self.cache, consumers, epoch=spec.epoch,
            datasets=self._key_datasets, share_cached=None if self._mix is not None else share_cached,
            ident=(self.manifest.dataset_id, self.seed, self.dp_size, self.num_nodes, spec.node),
            parts=self._mix is None and self.source.partial_reads)
        return replace(spec, **self._in_place_chunk(spec, fields))

    def _in_place_chunk(self, spec: PlanSpec, fields: dict[str, Any]) -> dict[str, Any]:
        """``fields`` (``mix_fields``) with a node mix's chunk enlarged where its rows are read in
        place: the chunk (in shard bytes) bounds what a consumer's decoded rows hold in memory, and
        rows in raw blocks hold none (zero-copy views of the cached files). So where the shards'
        ``inflation`` (bytes decompressed per byte) is below 1 the chunk is that much larger, up to
        ``_IN_PLACE_GROWTH`` times, in as many fewer runs. Not for a part mix (a cold epoch), a
        mixed dataset, or a chunk the user set (``shuffle_chunk``)."""
        if (self.shuffle_chunk or self._mix is not None or "part_bytes" in fields or not fields.get("mix_bytes")
                or not isinstance(self.source, ShardSource)):
            return fields
        if self._inflation is None:
            share = mixed_share(self.counts, replace(spec, **fields))
            shards = share if share is not None and len(share) else np.arange(len(self.counts))
            self._inflation = self.source.inflation(int(s) for s in shards[[0, len(shards) // 2, -1]])
        if self._inflation is None:
            return fields
        grow = 1 / min(1.0, max(self._inflation, 1 / _IN_PLACE_GROWTH))
        return {**fields, "chunk_bytes": int(fields["chunk_bytes"] * grow), "in_place": self._inflation == 0}

    def _sources(self) -> list[ShardSource]:
        """The shard sources behind this dataset (a mix's streams', or its one)."""
        return list(self.source.sources) if isinstance(self.source, MixedSource) else [self.source]

    def _num_nodes(self) -> int:
        """Nodes the data-parallel ranks spread over (``dist.plan_nodes``); 1 (a global plan) when
        ``dp_rank``/``dp_size`` were given apart from ``dist``."""
        d = self.dist  # plan_nodes checks ``placement``
        nodes = plan_nodes(d.world_size, d.local_world_size, self.replication, self.placement)
        return nodes if d.world_size == self.dp_size * self.replication else 1

    def _node_dp_ranks(self) -> list[int]:
        if self.dist.world_size == self.dp_size * self.replication and self.dist.world_size > 1:
            return node_dp_ranks(self.dist.node_ranks(), self.replication)
        return [self.dp_rank]

    def __len__(self) -> int:
        """Samples this rank reads per epoch; in the batched mode asked of the constructor
        (``StreamingDataset(batch_size=B)``) its batches (``num_batches()``), so ``len(DataLoader(ds,
        batch_size=None))`` is what comes. A ``datacache.DataLoader(ds, batch_size=B)`` over a
        samples-mode dataset leaves ``len(ds)`` the sample count; ``len(loader)`` is its batches."""
        return self.num_batches() if self.batch_size is not None and not self._loader_batched else self._samples()

    def num_batches(self) -> int:
        """Batches this rank yields per epoch in batched mode (samples without a ``batch_size``),
        exact for any number of DataLoader workers (they get whole batches: the plan's step 3)."""
        if self.batch_size is None:
            return self._samples()
        spec = self._spec(1, 0, mixes=False)
        if self._mix is not None and self._mix.batching == "per_stream":  # batches end where streams change
            order = self._mix.epoch_order(spec)
            return len(self._mix.batch_cuts(build_plan(self.counts, spec, order=order).samples, self.batch_size))
        return -(-self._samples(spec) // self.batch_size)

    def _samples(self, spec: PlanSpec | None = None) -> int:
        """Samples this rank reads per epoch (of the plan ``spec``, default this epoch's)."""
        spec = spec or self._spec(1, 0, mixes=False)
        order = None if self._mix is None else self._mix.epoch_order(spec)
        return len(build_plan(self.counts, spec, order=order, shards_only=True))

    def __getitem__(self, index: Any) -> Any:
        """Refused: a ``StreamingDataset`` is iterated (its seeded plan orders the reads)."""
        raise TypeError(f"datacache: StreamingDataset is iterable, not indexable (ds[{index!r}]): iterate it "
                        "(for sample in ds, or a DataLoader), or open datacache.CachedDataset(url) for reads by index")

    def _check_loader(self, caller: FrameType | None) -> None:
        """Refuse a DataLoader that batches batched mode's batches again."""
        n = loader_batch(caller) if self.batch_size is not None else None
        if n is not None:
            raise ValueError(f"datacache: StreamingDataset(batch_size={self.batch_size}) yields whole batches and the "
                             f"DataLoader batches them again (its batch_size={n}; 1 is the default): pass "
                             "batch_size=None to the DataLoader, or drop batch_size from the dataset")

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        """A new iteration, of the next epoch when ``set_epoch`` is never called; it ends the one
        this process had going (whose next item raises)."""
        self._iterations += 1
        self._begin_epoch(tud.get_worker_info())
        return self._iterate(self._iterations)

    def _iterate(self, iteration: int) -> Iterator[Any]:
        self._check_current(iteration)
        info = tud.get_worker_info()
        self._in_workers.fill_(int(info is not None))
        caller = sys._getframe().f_back
        self._check_loader(caller)
        if info is not None and self.batch_size is None:  # torch's own batches are the turns to deal (plan step 3)
            self._turn = loader_batch(caller) or 1
        if info is not None:  # a DataLoader worker: stop downloading the moment the training process dies
            die_with_parent()
        if self._resume is not None and self._resume.epoch != self.epoch:
            self._resume = None  # set_epoch moved on (seen here only through the shared epoch)
        num_workers, worker_id = (info.num_workers, self._plan_worker(info)) if info is not None else (1, 0)
        self._worker = (worker_id, num_workers)
        spec = resume_spec(self._spec(num_workers, worker_id), self._resume)
        order, skip = resume_plan(self.counts, spec, self._resume, orders=self._mix)
        ahead, self._next_plan = self._next_plan, None
        plan, consumer = ahead.take(spec, opened=skip == 0) if ahead is not None and order is None else (None, None)
        if ahead is not None:
            ahead.close()  # what it opened and we do not take
        if self._consumer is not None:
            self._consumer.close()
        if consumer is None:  # else planned and opened ahead, its first chunks read already
            consumer = self._open(spec, plan or build_plan(self.counts, spec, order=order), order, skip)
        self._consumer = consumer
        self._resume_base = self._resume
        self._resume = None
        yield from self._emit(consumer, iteration)
        if info is not None and self._plan_ahead and self._mix is None and iteration == self._iterations:
            try:
                self._next_plan = self._plan_next(spec)
            except Exception as exc:  # noqa: BLE001 - a guess: the next epoch then starts as without it
                log.debug("datacache: cannot start the next epoch of %s ahead: %r", self._label(), exc)

    def _open(self, spec: PlanSpec, plan: ConsumerPlan, order: np.ndarray | None, skip: int) -> Consumer:
        """The consumer of ``plan`` (``spec``'s, from position ``skip``), its schedule told to the
        cache: its threads start reading at once."""
        schedule = None
        if self.cache.config.policy != "lru":
            ranks = self._node_dp_ranks() if order is None else [self.dp_rank]
            share = self.cache.control_dir if worth_sharing(len(self.counts), ranks, spec.num_workers) else None
            times = node_schedule(self.manifest, self.counts, spec, ranks, first_plan_order=order,
                                  share_dir=share, orders=self._mix)
            owned = owned_keys(self._sources()) if self._peers is not None else {}
            if owned and self._mix is None and not spec.node_placed:  # global placement: peers read what we own
                times = with_cluster_times(times, self.manifest, self.counts, spec,
                                           owned.get(self.manifest.dataset_id, frozenset()), share)
            schedule = tell_plan(self.cache, times, owned)
        prefetch = cap_lookahead(self.prefetch, self.cache, self.manifest,
                                 len(self._node_dp_ranks()) * spec.num_workers)
        # Batched mode's default collation without a transform: runs read as tables, batches gathered
        # (datacache.pytorch.gather); a node mix's compressed blocks decompressed once per epoch.
        columnar = self._columnar()
        if columnar:  # a part mix reads samples; its shards' readers prepare the warm epochs' tables
            self.source.tables = True
        return Consumer(source=self.source, plan=plan, epoch=spec.epoch, skip=skip, prefetch=prefetch,
                        schedule=schedule, on_error=self.on_error, lead=self._lead(spec, order, skip, plan.parts),
                        marks=self._skips, columnar=columnar,
                        block_cache=2 * spec.chunk_bytes if plan.rows is not None else 0,
                        name=f"datacache-prefetch-r{self.dp_rank}w{spec.worker_id}")

    def _columnar(self) -> bool:
        """Whether batches are gathered from tables (``datacache.pytorch.gather``)."""
        return (self.batch_size is not None and self.collate_fn is collate and self.transform is None
                and self._mix is None and getattr(self.source.fmt.reader, "columns", None) is not None)

    def _plan_next(self, spec: PlanSpec) -> NextEpoch:
        """The epoch expected after ``spec``'s, planned on a thread and, where every shard it reads
        is cached, opened (``next_plan``): a persistent DataLoader worker's next iteration takes it if
        its spec plans the same."""
        nxt = expected_spec(spec)
        if spec.part_bytes:  # the warm node mix after a cold part mix: its chunk as _spec sets it
            fields = {"mix_bytes": nxt.mix_bytes, "chunk_bytes": nxt.chunk_bytes}
            nxt = replace(nxt, **self._in_place_chunk(nxt, fields))

        def open_cached(plan: ConsumerPlan) -> Consumer | None:  # no fetch, no eviction ahead of the epoch
            shards = {run[0] for run in plan.runs}
            if not self.cache.contains_all(self.manifest.cache_key(int(s)) for s in shards):
                return None
            return self._open(nxt, plan, None, 0)
        return NextEpoch(self.counts, nxt, open_cached)

    def _check_current(self, iteration: int) -> None:
        """Raise if ``iteration`` was ended by a newer ``iter()`` in this process."""
        if iteration != self._iterations:
            raise RuntimeError(
                f"datacache: this iteration over {self._label()} was ended by a new iter() over the same "
                "StreamingDataset in this process (one iteration at a time per dataset object): finish or break "
                "out of the old loop before starting a new one, or open a second StreamingDataset to read twice")

    def _label(self) -> str:
        """The dataset's URL (a mix: its streams'), for messages."""
        return self.source.label if isinstance(self.source, MixedSource) else self.store.url

    def _lead(self, spec: PlanSpec, order: Any, skip: int, parts: bool) -> tuple[list[LeadItem], list[LeadItem]]:
        """The other DataLoader workers' first reads, (before this one, after it), that this worker
        gets ahead of its own first and of its lookahead (``Consumer``'s ``lead``): at an epoch's
        start, with ``PrefetchConfig.slow_start``, their first shards; in a part-mixed epoch (``parts``), the
        runs of their first chunks (which every worker needs at once: without it, the first batch's
        blocks shared the link with the second's); else none."""
        if skip or spec.num_workers < 2 or not self.prefetch.slow_start:
            return [], []
        w = spec.worker_id
        if parts:
            head = part_chunk(spec.batch_size, 1 << 62)  # at least a part mix's first chunk
            runs = [[(shard, rows) for _, shard, _, rows in first_chunks(
                build_plan(self.counts, replace(spec, worker_id=v), order=order, shards_only=True, head=head),
                self.epoch, 1)] for v in range(spec.num_workers)]
            return [r for v in runs[:w] for r in v], [r for v in runs[w + 1:] for r in v]
        firsts = first_shards(self.counts, spec, order)
        return ([s for s in firsts[:w] if s is not None and s != firsts[w]],
                [s for s in firsts[w + 1:] if s is not None and s != firsts[w]])

    def _emit(self, consumer: Consumer, iteration: int) -> Iterator[Any]:
        transform = self.transform
        self._delivered: int | None = None
        if self.batch_size is None:
            for sample in consumer:
                yield transform(sample) if transform else sample
                if iteration != self._iterations:
                    self._check_current(iteration)
            self._flush_stats(consumer)
            return
        # Batched mode (datacache.pytorch.batches). The default collation writes batches into a reusable
        # ring (shared with the main process when this is a DataLoader worker): datacache.pytorch.batches.
        info = tud.get_worker_info()
        worker = info is not None
        collate_fn = self._ring(shared=worker) if self.collate_fn is collate else self.collate_fn
        gather = Gatherer(collate_fn) if consumer.columnar else None
        if worker:  # what the ring did not take goes into shared memory here, where a failure is raised
            collate_fn = sharing(collate_fn)

        def mark(position: int) -> None:  # what state_dict records: the position after the last batch out
            self._delivered = position

        plan_batches = self._batches(consumer.plan, consumer.skip)
        if gather is not None:
            batches = gathered(consumer, plan_batches, sharing(gather) if worker else gather, mark)
        else:
            batches = batched(consumer, plan_batches, collate_fn, transform, mark)
        try:
            bundles = info is not None and self._bundle
            for item in bundled(batches, info.id, self._bundle, defer=not self._pin) if bundles else batches:
                yield item
                self._check_current(iteration)
        finally:
            batches.close()
        self._flush_stats(consumer)

    def _batches(self, plan: ConsumerPlan, skip: int) -> WorkerBatches:
        """The batches a consumer of ``plan`` yields from position ``skip`` on (batched mode)."""
        size = self.batch_size or 1
        cuts = self._mix.batch_cuts(plan.samples, size, after=skip) \
            if self._mix is not None and self._mix.batching == "per_stream" else None
        return WorkerBatches(start=skip, length=len(plan), size=size, cuts=None if cuts is None else tuple(cuts))

    def _ring(self, shared: bool) -> RingCollator:
        """This process's batch ring, kept across epochs (a forked worker makes its own)."""
        ring = self._collator
        if ring is None or ring.pid != os.getpid() or ring.shared != shared or ring.pin != self._pin:
            ring = self._collator = RingCollator(shared=shared, pin=self._pin, bytes_views=self.bytes_views,
                                                 slots=self._ring_slots)
        return ring

    def _flush_stats(self, consumer: Consumer) -> None:
        """Add the epoch's figures to the node's counters and to the dataset's own (``stats()``)."""
        p = consumer.decoder
        store = self._unflushed_store(mark=True)
        info = tud.get_worker_info()
        self._own.add(0 if info is None else 1 + info.id, samples=consumer.consumed - consumer.skip,
                      wait_seconds=p.wait_seconds, skipped_shards=consumer.reported_skips, **store)
        self._flushed = consumer
        self.cache.count(wait_seconds=p.wait_seconds, waits=p.waits, samples=consumer.consumed,
                         padded=consumer.plan.padded if consumer.skip == 0 else 0,
                         storage_retries=store["retries"])
        p.wait_seconds, p.waits = 0.0, 0
        self.cache.flush_stats()

    def _unflushed_store(self, mark: bool = False) -> dict[str, int]:
        """This process's store counters (``datacache.pytorch.shared.STORE_FIELDS``: bytes read, requests, retries)
        not yet added to the node's ``storage_retries`` and the dataset's own figures (a forked
        DataLoader worker's store counts from zero); with ``mark`` they count as added now."""
        stores = self.source.stores() if self._mix is not None else [self.store]  # type: ignore[union-attr]
        totals = [st.stats() for st in stores]
        now = {ours: sum(t[theirs] for t in totals) for ours, theirs in STORE_FIELDS.items()}
        pid, done = getattr(self, "_store_flushed", (-1, {}))
        if mark:
            self._store_flushed = (os.getpid(), now)
        return {k: v - (done.get(k, 0) if pid == os.getpid() else 0) for k, v in now.items()}

    # ------------------------------------------------------------------ stats / lifecycle
    def stats(self) -> dict[str, Any]:
        """First, under ``"dataset"``, this dataset's own figures (``datacache.pytorch.shared``): its
        ``epoch``, and since it was made, over this process and its DataLoader workers (theirs as of
        their last finished epoch): ``samples`` delivered, ``remote_bytes`` read from the store and
        its ``requests`` and ``retries``, ``skipped_shards``, ``wait_seconds`` its consumers waited
        for data. Every other key is node-wide: the node cache's counters, summed over every
        process and dataset sharing the cache since it was created or reset, plus this process's
        consumer: wait seconds, prefetch depth.
        ``storage_retries``: retried storage requests (every consumer's finished epochs on the node,
        plus this process's so far). ``storage_throttled``, ``storage_throttle_seconds``,
        ``storage_concurrency``: the node's throttling answers from this store prefix, seconds spent
        throttled, and its congestion window now (``datacache.store.congestion``). ``peers``: the peer
        tier's node-wide figures (``datacache.read.peers.PEER_STATS``: bytes from peers and from the
        store through it, bytes served to peers, corrupt answers refetched, fallbacks, hedges,
        requests refused for bad auth), whether it is ``enabled``, this ``node`` and the ``nodes``. ``stash_bytes``: the
        samples this process's consumer holds read ahead for its later runs in a part-mixed cold
        epoch (``datacache.read.stash``; 0 otherwise)."""
        store = self._unflushed_store()
        c = self._consumer
        live: dict[str, float] = dict(store)
        if c is not None:
            live["wait_seconds"] = c.decoder.wait_seconds  # reset when added
            if c is not self._flushed:
                live.update(samples=c.consumed - c.skip, skipped_shards=c.reported_skips)
        out: dict[str, Any] = {"dataset": {"epoch": self.epoch, **self._own.totals(**live)}}
        out.update(self.cache.stats())
        out["storage_retries"] = int(out.get("storage_retries", 0)) + store["retries"]
        out["peers"] = peer_stats(out, self._peers)
        cong = self.store.congestion.stats()
        out.update(storage_throttled=cong["throttled"], storage_throttle_seconds=cong["throttle_seconds"],
                   storage_concurrency=cong["concurrency"])
        if c is not None:
            out["consumer_wait_seconds"] = c.decoder.wait_seconds
            out["prefetch_depth"] = c.prefetcher.depth
            out["prefetch_threads"] = c.prefetcher.active_threads
            out["lookahead_bytes"] = c.prefetcher.lookahead
            out["stash_bytes"] = c.stash_bytes
        return out

    def close(self) -> None:
        """Stop prefetching and release pinned shards. Idempotent."""
        ahead, self._next_plan = self._next_plan, None
        if ahead is not None:
            ahead.close()
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._collator is not None and self._collator.pid == os.getpid():
            self._collator.close()
            self._collator = None
        mapper, self._mapper = self._mapper, None
        if mapper is not None:
            mapper.close()
        crossread.FILES.close()  # the tier files this process mapped to copy values from

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_consumer"] = state["_collator"] = state["_flushed"] = state["_next_plan"] = state["_mapper"] = None
        return state

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def state_dict(self) -> dict[str, Any]:
        """Where this consumer is: epoch and samples delivered per worker (``ResumeState.to_dict``).

        Called in the main process (``num_workers=0``) or, by ``StatefulDataLoader``, in each worker
        (a worker's state holds only its own count; the loader's state holds them all). In the main
        process while DataLoader workers iterate, the position is in the workers: ``RuntimeError``.
        """
        info = tud.get_worker_info()  # in a DataLoader worker, valid even before __iter__ ran
        if info is None and int(self._in_workers):
            raise RuntimeError("StreamingDataset.state_dict() in the main process while DataLoader workers read it: "
                               "the position is in the workers; checkpoint torchdata's StatefulDataLoader.state_dict() "
                               "instead (StreamingDataset.load_state_dict accepts it)")
        worker_id, num_workers = self._worker
        if info is not None:  # the plan worker it plays, or (before __iter__) will play
            worker_id, num_workers = (self._worker if self._consumer is not None else
                                      (self._plan_worker(info), info.num_workers))
        if self._resume is not None and info is None:  # loaded but not iterated yet: at the loaded position
            return self._resume.to_dict()
        spec = self._spec(num_workers, worker_id)
        if self._resume is not None:
            return self._resume.pending(dp_size=self.dp_size, dp_rank=self.dp_rank, num_workers=num_workers,
                                        worker_id=worker_id, batch_size=self.batch_size or 1,
                                        num_nodes=self.num_nodes, mix=plan_mix(spec)).to_dict()
        base = self._resume_base
        if base is None or base.epoch != self.epoch:
            base = start_state(epoch=self.epoch, seed=self.seed, dataset_id=self.manifest.dataset_id,
                               dp_size=self.dp_size, dp_rank=self.dp_rank, num_workers=num_workers,
                               batch_size=self.batch_size or 1, num_nodes=self.num_nodes, mix=plan_mix(spec))
        mix = plan_mix(resume_spec(spec, base))  # what this epoch's plan used
        consumed = 0
        if self._consumer is not None and self._consumer.epoch == self.epoch:
            delivered = getattr(self, "_delivered", None)
            consumed = self._consumer.consumed if delivered is None else delivered
        return base.advanced(dp_size=self.dp_size, dp_rank=self.dp_rank, num_workers=num_workers,
                             worker_id=worker_id, consumed=consumed, batch_size=self.batch_size or 1,
                             num_nodes=self.num_nodes, mix=mix).to_dict()

    def _plan_worker(self, info: Any) -> int:
        """The plan worker DataLoader worker ``info.id`` plays (``ResumeState.plan_worker``)."""
        st = self._resume
        if st is None or not st.same_layout(self.dp_size, info.num_workers, self.batch_size or 1, self.num_nodes):
            return int(info.id)
        return st.plan_worker(info.id, info.num_workers)

    def worker_rounds(self, num_workers: int) -> Rounds:
        """Where a ``DataLoader`` with ``num_workers`` workers starting an iteration now begins
        (the loaded state, if any, else the epoch's start), and each worker's batches (built on
        first use): ``datacache.pytorch.rounds``, for ``datacache.DataLoader``'s state. Call it before
        the loader starts its workers, then ``resume_started()`` once they have."""
        resume = self._pending()
        layout = dict(dp_size=self.dp_size, dp_rank=self.dp_rank, num_workers=num_workers,
                      batch_size=self.batch_size or 1, num_nodes=self.num_nodes)
        spec0 = self._spec(num_workers, 0)
        start = resume or start_state(epoch=self.epoch, seed=self.seed, dataset_id=self.manifest.dataset_id,
                                      mix=plan_mix(spec0), **layout)

        def workers() -> list[WorkerBatches]:
            return [self._batches(*self._worker_plan(num_workers, w, resume, start.epoch)) for w in range(num_workers)]

        base = start.advanced(worker_id=0, consumed=0, mix=plan_mix(resume_spec(spec0, resume)), **layout)
        return Rounds(base=base, make_workers=workers)

    def head_start(self, num_workers: int, *, start: bool = True) -> HeadStart | None:
        """Fetch, from this (the training) process, the first shards of ``num_workers`` DataLoader
        workers that have just begun the epoch (``datacache.read.headstart``), or a part-mixed epoch's
        first chunks' rows; ``None`` when a resume is pending (the workers start mid-plan), the
        epoch is a node mix, or there is nothing to read. ``start=False``: planned (the workers'
        plans computed and memoized in this process), its threads started by ``HeadStart.start``."""
        if self._pending() is not None:
            return None
        spec0 = self._spec(num_workers, 0)
        if self._mix is None and mixed_share(self.counts, spec0) is not None:
            return self._part_head_start(num_workers, start) if spec0.part_bytes > 0 else None
        runs = []
        for w in range(num_workers):
            plan, _ = self._worker_plan(num_workers, w, None, self.epoch, shards_only=True)
            times = plan.run_times(self.epoch)
            runs += [(k, w, plan.runs[k][0], times[k]) for k in range(min(RUNS_PER_WORKER, len(plan.runs)))]
        if not runs:
            return None
        return HeadStart(self.source, [(shard, t) for _, _, shard, t in sorted(runs)],
                         name=f"datacache-headstart-r{self.dp_rank}", start=start)

    def tier_mapper(self, num_workers: int) -> TierMapper | None:
        """A ``TierMapper`` (``datacache.pytorch.tiermap``), not started, for the part-mixed (cold)
        epoch ``num_workers`` DataLoader workers are about to begin, where the warm epochs' large
        ``bytes`` values will be copied from this process's mappings of the node's tier files
        (``crossread``); None where it would map nothing of use: no workers, a mixed dataset,
        batches not gathered from tables or with ``bytes_views``, no ``bytes`` field or samples
        averaging under ``crossread.MIN_MEAN_BYTES``, an epoch that is not part-mixed (its shards
        cached already), a node share larger than the RAM tier or than the files ``FILES`` keeps,
        or cross-process reads off here. Closes the one of the last iteration (ended, or left
        waiting by an iteration stopped early); the one made is closed with the dataset."""
        old, self._mapper = self._mapper, None
        if old is not None:
            old.close()
        m, files = self.manifest, crossread.FILES
        if (not num_workers or not self._columnar() or self.bytes_views or "bytes" not in m.schema.values()
                or m.total_bytes < crossread.MIN_MEAN_BYTES * m.num_samples or self._pending() is not None
                or not files.on or not crossread.available(os.getpid())):
            return None
        spec = self._spec(num_workers, 0)
        share = mixed_share(self.counts, spec) if spec.part_bytes > 0 else None
        if share is None or not 0 < len(share) <= files.capacity or \
                int(self.shard_bytes[share].sum()) > self.cache.budgets()["ram"]:
            return None
        shards = [int(s) for s in share]
        source = self.source
        self._mapper = TierMapper(self.cache, [m.cache_key(s) for s in shards], shards,
                                  worth=lambda shard: source.inflation([shard]) == 0,
                                  name=f"datacache-tiermap-r{self.dp_rank}")
        return self._mapper

    def _part_head_start(self, num_workers: int, start: bool) -> HeadStart | None:
        """The head start of a part-mixed epoch: the runs of each worker's first ``RUNS_PER_WORKER``
        chunks (a chunk: one run per shard it touches), chunk by chunk across the workers, on as
        many threads as the store has ranged reads in flight. Each worker's plan is planned for
        those chunks only (``build_plan(head=...)``: 0.05 s for two workers of a 200,000-sample
        part mix, not 0.2 s); their next use is the epoch's start."""
        runs = []
        head = RUNS_PER_WORKER * part_chunk(self.batch_size or 1, 1 << 62)  # the first chunks' positions, at least
        for w in range(num_workers):
            plan, _ = self._worker_plan(num_workers, w, None, self.epoch, shards_only=True, head=head)
            if not plan.parts:
                return None
            runs += [(c, w, k, shard, float(self.epoch), rows)
                     for k, (c, shard, _, rows) in enumerate(first_chunks(plan, self.epoch, RUNS_PER_WORKER))]
        if not runs:
            return None
        runs.sort(key=lambda r: r[:3])
        return HeadStart(self.source, [(r[3], r[4]) for r in runs], rows=[r[5] for r in runs],
                         threads=self.source.store.transfer.range_requests,
                         name=f"datacache-headstart-r{self.dp_rank}", start=start)

    def _pending(self) -> ResumeState | None:
        """The loaded state not yet iterated, if it is of the current epoch."""
        st = self._resume
        return st if st is not None and st.epoch == self.epoch else None

    def _worker_plan(self, num_workers: int, w: int, resume: ResumeState | None, epoch: int,
                     shards_only: bool = False, head: int | None = None) -> tuple[ConsumerPlan, int]:
        """(plan, plan positions already delivered) of DataLoader worker ``w`` of ``num_workers``
        in ``epoch``, continuing from ``resume``: what that worker's ``__iter__`` computes
        (``head``: of a mixed plan, its first ``head`` positions only, ``build_plan``)."""
        spec = resume_spec(self._spec(num_workers, w, epoch=epoch), resume)
        order, skip = resume_plan(self.counts, spec, resume, orders=self._mix)
        return build_plan(self.counts, spec, order=order, shards_only=shards_only, head=head), skip

    def resume_started(self) -> None:
        """A loader's workers took the loaded state (``worker_rounds``) and the epoch of
        ``start_iteration``: the state is no longer pending, workers forked later decide their own."""
        self._resume_base, self._resume = self._resume, None
        self._follow = False

    def load_state_dict(self, state: Any) -> None:
        """Resume from ``state`` at the next ``__iter__`` (possibly with another world size or
        ``num_workers``). ``state``: what ``state_dict()`` returned, a ``StatefulDataLoader``'s
        ``state_dict()``, a ``ResumeState``, or a list of several old ranks' states (checked to
        agree; see ``datacache.plan.resume`` for which state each new rank loads). ``ValueError`` if the
        state is from another dataset or seed, or lacks counts this resume needs."""
        st = common_state(state) if isinstance(state, (list, tuple)) else rank_state(state)
        st.check_dataset(self.manifest.dataset_id, self.seed)
        info = tud.get_worker_info()
        if info is not None and self._epoch_explicit and st.epoch != self.epoch:
            # StatefulDataLoader loads worker states only at worker start, after the training loop's
            # set_epoch: an epoch selected there that differs from the state's wins, as set_epoch
            # after load_state_dict does in the main process (e.g. saved at the end of epoch e,
            # resumed with set_epoch(e + 1)).
            self._resume = None
            return
        if info is not None:  # torchdata gave this worker its own state: refuse one it cannot use
            st.check_layout(self.dp_size, info.num_workers, self.batch_size or 1, self.num_nodes)
        self.epoch = st.epoch
        self._resume, self._resume_pid = st, os.getpid()
        if info is None:
            self._epochs.clear()  # without set_epoch, the iteration after this one reads st.epoch + 1


