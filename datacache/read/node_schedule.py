"""What the consumers of one node will read, and when: the node-level view of the epoch plan.

A node runs several consumers (data-parallel ranks times DataLoader workers). The cache is shared
by all of them, so it must know all of their reads: ``node_schedule`` gives the next-use times of
every shard for every consumer of the node (this epoch and the next), ``warm_order`` the order in
which the node first needs its shards, and ``cap_lookahead`` bounds what the consumers may pin
ahead. ``node_dp_ranks`` maps the global ranks of a node to its data-parallel ranks;
``mix_fields`` decides, alike in every process of the node, whether its epochs are node mixes;
``key_datasets`` names the cache-key datasets of a dataset. Pure functions of the plan, except
the mix decision, which is made once per node and epoch (``auto_budget``); thread-safe.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from ..cache.eviction import Schedule
from ..cache.node import NodeCache
from ..cache.node_policy import NodePolicy, dataset_of
from ..config import PrefetchConfig
from ..manifest import Manifest
from ..plan.epoch import DEFAULT_WINDOW, EpochOrders, PlanSpec, build_plan, mixed_share
from ..plan.node_share import digest, readonly, shared_array
from ..plan.node_shuffle import DEFAULT_CHUNK_BYTES, MIX_SHARE
from ..plan.part_shuffle import PART_BYTES, PART_NARROW, PART_STRATA

__all__ = ["node_schedule", "warm_order", "cap_lookahead", "node_dp_ranks", "mix_fields", "auto_budget",
           "key_datasets", "sliding_window", "NODE_SHUFFLE"]


def node_dp_ranks(ranks: Iterable[int], replication: int = 1) -> list[int]:
    """The data-parallel ranks of the global ``ranks`` of a node, when ``replication``
    consecutive ranks (a tensor/pipeline-parallel group) read the same samples."""
    return sorted({int(r) // max(int(replication), 1) for r in ranks})


SHARE_MIN_RUNS = 1 << 16  # runs per epoch (shards x the node's consumers) below which sharing costs more


def worth_sharing(shards: int, dp_ranks: Sequence[int], num_workers: int) -> bool:
    """Whether the node schedule is worth sharing through files (``node_schedule(share_dir=)``):
    below ``SHARE_MIN_RUNS`` runs a consumer computes it in less time than a shared file's
    write, fsync and lock take, which an epoch of cached data would otherwise wait for."""
    return shards * max(len(dp_ranks), 1) * max(num_workers, 1) >= SHARE_MIN_RUNS


def node_schedule(manifest: Manifest, counts: np.ndarray, spec: PlanSpec, dp_ranks: Sequence[int],
                  first_plan_order: np.ndarray | None = None, share_dir: str | None = None,
                  orders: EpochOrders | None = None) -> Schedule:
    """Next-use times of every shard for every consumer of the node (data-parallel ranks
    ``dp_ranks`` x ``spec.num_workers`` workers), for ``spec.epoch`` and the next epoch.
    ``first_plan_order``: the order that replaces this epoch's global order (a resume).
    ``share_dir`` (the node cache's control directory): computed once per node, by the first of
    its consumers, and read by the others (``datacache.plan.node_share``). ``orders``: the epochs' own
    orders (a mixed dataset's)."""
    ranks = [int(r) for r in dp_ranks]
    later = None if orders is None else orders.epoch_order(dataclasses.replace(spec, epoch=spec.epoch + 1))
    ident = (digest(readonly(counts)), digest(spec.shard_bytes) if spec.node_placed else None,
             digest(first_plan_order), spec.seed, spec.epoch, spec.shuffle, spec.window, spec.drop_last,
             spec.dp_size, spec.num_workers, spec.batch_size, spec.num_nodes, spec.placement, ranks,
             spec.mix_bytes, spec.mix_from, spec.chunk_bytes, spec.in_turns,
             digest(later),
             None if orders is None or first_plan_order is not None else digest(orders.epoch_order(spec)))
    name = "schedule-v2-" + hashlib.blake2b(repr(ident).encode(), digest_size=16).hexdigest()
    shards = len(counts)
    table = shared_array(share_dir, name, lambda: _schedule_table(counts, spec, ranks, first_plan_order, orders),
                         lambda a: a.dtype == _TABLE and a.ndim == 1
                         and bool(np.all((a["shard"] >= 0) & (a["shard"] < shards))))
    times: dict[str, list[float]] = {}
    for shard, t in zip(table["shard"].tolist(), table["time"].tolist()):
        times.setdefault(manifest.cache_key(shard), []).append(t)
    return Schedule(times)


_TABLE = np.dtype([("shard", "<i8"), ("time", "<f8")])


def _schedule_table(counts: np.ndarray, spec: PlanSpec, dp_ranks: list[int], first_plan_order: np.ndarray | None,
                    orders: EpochOrders | None = None) -> np.ndarray:
    """(shard, time) of every run of every consumer of the node, this epoch and the next; in a
    node-mixed epoch, every shard of the node's share once at the epoch's start (all of them are
    read throughout it), without building the consumers' plans."""
    rows: list[tuple[int, float]] = []
    for epoch in (spec.epoch, spec.epoch + 1):
        first = first_plan_order if epoch == spec.epoch else None
        share = None if orders is not None or not dp_ranks else \
            mixed_share(counts, dataclasses.replace(spec, epoch=epoch, dp_rank=dp_ranks[0]), first)
        if share is not None:  # a node mix: every consumer reads every shard of the share all epoch long
            rows += [(int(s), float(epoch)) for s in share]
            continue
        for r in dp_ranks:
            for w in range(spec.num_workers):
                sub = dataclasses.replace(spec, epoch=epoch, dp_rank=r, worker_id=w)
                order = first_plan_order if epoch == spec.epoch and first_plan_order is not None else \
                    None if orders is None else orders.epoch_order(sub)
                rows += build_plan(counts, sub, order=order, shards_only=True).shard_times(epoch)
    return np.array(rows, dtype=_TABLE)


def warm_order(counts: np.ndarray, spec: PlanSpec, dp_ranks: Sequence[int],
               orders: EpochOrders | None = None) -> list[int]:
    """The shards this node's consumers need, first need first: every consumer's (data-parallel rank
    in ``dp_ranks``, worker in ``range(spec.num_workers)``) shard sequence for ``spec.epoch``,
    interleaved by node-clock time (``ConsumerPlan.shard_times``), deduplicated. ``orders``: the
    epoch's own order (a mixed dataset's)."""
    events: list[tuple[float, int, int, int]] = []
    consumer = 0
    for r in dp_ranks:
        for w in range(max(spec.num_workers, 1)):
            sub = dataclasses.replace(spec, dp_rank=r, worker_id=w)
            plan = build_plan(counts, sub, order=None if orders is None else orders.epoch_order(sub), shards_only=True)
            last, j = None, 0
            for shard, t in plan.shard_times(spec.epoch):
                j = j + 1 if t == last else 0  # shards of one window share its start time: keep run order
                last = t
                events.append((t, j, consumer, shard))
            consumer += 1
    events.sort()
    return list(dict.fromkeys(shard for *_, shard in events))


def cap_lookahead(prefetch: PrefetchConfig, cache: NodeCache, manifest: Manifest, consumers: int) -> PrefetchConfig:
    """Cap the lookahead so the node's ``consumers`` pin at most a quarter of the fastest tier:
    pinned entries cannot be evicted, and a cache full of pins serves nothing twice."""
    budget = next((b for b in cache.budgets().values() if b > 0), 0)
    if budget == 0:
        return prefetch
    biggest = max((s.bytes for s in manifest.shards), default=1)
    cap = max(budget // (4 * max(consumers, 1)), biggest)
    la = min(int(prefetch.lookahead_bytes), cap)
    return dataclasses.replace(prefetch, lookahead_bytes=la,
                               max_lookahead_bytes=max(la, min(int(prefetch.max_lookahead_bytes), cap)))


NODE_SHUFFLE = ("auto", "always", "never", "window", "parts")
_ALWAYS = 1 << 62


def sliding_window(ram_bytes: int, consumers: int, shard_bytes: int) -> int:
    """The default sliding window (in shards): ``DEFAULT_WINDOW``, fewer (down to 1) when the
    node's ``consumers`` would hold more decoded shards than the RAM tier's configured budget
    (``ram_bytes``; a consumer holds its window's runs). The configured budget, not the one a
    process found free, so that every process of the node plans alike."""
    if ram_bytes <= 0:
        return DEFAULT_WINDOW
    return int(min(DEFAULT_WINDOW, max(1, ram_bytes // (max(consumers, 1) * max(shard_bytes, 1)))))


def mix_fields(node_shuffle: str, shuffle_chunk: int | None, cache: NodeCache, consumers: int, *, epoch: int,
               datasets: frozenset[str], ident: tuple,
               share_cached: Callable[[int], bool] | None = None, parts: bool = False) -> dict[str, int]:
    """The ``PlanSpec`` fields of the node mix (``datacache.plan.node_shuffle``) in ``epoch`` for a dataset
    on ``cache`` read by the node's ``consumers``: ``"auto"`` mixes from epoch 1 on when the
    node's share is at most ``MIX_SHARE`` of the cache's budget and no other dataset is in use on
    the node (``auto_budget``), and epoch 0 too when the share is in the cache already
    (``share_cached(mix_bytes)``: a cache warmed with ``datacache warm``, a restarted job);
    ``"always"`` every epoch; ``"never"`` none. The chunk: the given ``shuffle_chunk`` bytes, else
    the RAM tier's budget over 8 x ``consumers``, within 1 to 64 MB. ``datasets``: the cache-key
    datasets of this one (a mix's streams); ``ident``: what else names this dataset's plan on the
    node (the decision is made once per node and epoch). ``"auto"`` also reads an epoch 0 whose
    share is not cached, but would be mixed once it is, as a part mix (``datacache.plan.part_shuffle``)
    where the dataset can be read part by part (``parts``: ``readers.base.ShardLayout``);
    ``"window"`` reads that epoch through the sliding window instead; ``"parts"`` is ``"auto"``."""
    if node_shuffle not in NODE_SHUFFLE:
        raise ValueError(f"node_shuffle={node_shuffle!r}: expected one of {', '.join(NODE_SHUFFLE)}")
    ram = cache.budgets().get("ram", 0)
    chunk = shuffle_chunk or min(DEFAULT_CHUNK_BYTES, max(1 << 20, ram // (8 * max(consumers, 1))))
    if node_shuffle == "never" or (node_shuffle != "always" and epoch < 1 and share_cached is None):
        return {"mix_bytes": 0, "chunk_bytes": chunk}
    if node_shuffle == "always":
        return {"mix_bytes": _ALWAYS, "mix_from": 0, "chunk_bytes": chunk}
    if epoch < 1:
        cached = auto_budget(cache, datasets, ident + (epoch,), require=share_cached)
        if cached or not parts or node_shuffle == "window":
            return {"mix_bytes": cached, "mix_from": 0, "chunk_bytes": chunk}
        return {"mix_bytes": auto_budget(cache, datasets, ident + (epoch, "parts")), "mix_from": 1,
                "chunk_bytes": chunk, "part_bytes": PART_BYTES, "part_narrow": PART_NARROW,
                "part_strata": PART_STRATA}
    return {"mix_bytes": auto_budget(cache, datasets, ident + (epoch,)), "mix_from": 1, "chunk_bytes": chunk}


def auto_budget(cache: NodeCache, datasets: frozenset[str], ident: tuple,
                require: Callable[[int], bool] | None = None) -> int:
    """``MIX_SHARE`` of the bytes ``cache`` can hold (every tier's budget) less what other
    datasets' entries hold in it now, or 0 while a dataset other than ``datasets`` is in use on
    the node (a published schedule: ``NodePolicy``): their shards compete for the cache, and a
    mixed epoch whose share is not all local would thrash it. Decided by the first process of the
    node to ask for ``ident`` and read by the others from the control directory, so every process
    of the node plans alike (budgets shrink to the free space each process sees when it opens the cache, and
    other datasets come and go); a resume on the node reads the same decision. ``require(budget)``:
    a further condition (0 unless it holds)."""
    name = "mix-v1-" + hashlib.blake2b(repr(ident).encode(), digest_size=16).hexdigest()
    known = _decided.get((os.getpid(), name))
    if known is not None:
        return known

    def decide() -> np.ndarray:
        if cache.others_reading(datasets):  # another dataset of this process, its plan not told yet
            return np.zeros(1, dtype=np.int64)
        policy = cache.policy
        if isinstance(policy, NodePolicy):
            policy.refresh(rescan=True)
            if set(policy.datasets()) - datasets:
                return np.zeros(1, dtype=np.int64)
        others = sum(e.size for key, e in cache.entries() if dataset_of(key) not in datasets)
        budget = max(0, int(MIX_SHARE * sum(cache.budgets().values())) - others)
        return np.array([budget if require is None or require(budget) else 0], dtype=np.int64)

    got = int(shared_array(cache.control_dir, name, decide,
                           lambda a: a.dtype == np.int64 and a.shape == (1,) and int(a[0]) >= 0)[0])
    _decided[(os.getpid(), name)] = got
    return got


_decided: dict[tuple[int, str], int] = {}  # (pid, decision name) -> mix_bytes: read once per process


def key_datasets(manifest: Manifest) -> frozenset[str]:
    """The datasets of ``manifest``'s cache keys (one; a mix's streams: several)."""
    return frozenset(dataset_of(manifest.cache_key(i)) for i in range(len(manifest.shards)))
