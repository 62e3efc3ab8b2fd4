"""``datacache warm``: fill this node's cache in the order its ranks will read."""
from __future__ import annotations

import dataclasses
import re
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._consumer import node_schedule
from .cache import NodeCache
from .config import format_size
from .eviction import ClairvoyantPolicy
from .manifest import Manifest, load_manifest
from .plan import PlanSpec, build_plan
from .storage import Store, open_store


from ._cli_common import (
    Ctx,
    UsageError,
    _fmt_ranks,
    _mbps,
    _Progress,
    _run_pool,
    _watch,
)

__all__ = ["cmd_warm", "warm_order", "parse_ranks"]


def parse_ranks(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (sorted, deduplicated)."""
    ranks: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise UsageError(f"--ranks: cannot parse {part!r}; use a list like 0-7 or 0,2,4-6")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise UsageError(f"--ranks: range {part!r} is backwards")
        ranks.update(range(lo, hi + 1))
    return sorted(ranks)


def _node_dp_ranks(a: Any) -> tuple[int, list[int], list[int]]:
    """(data-parallel size, data-parallel ranks on this node, global ranks on this node)."""
    world, k = a.world_size, a.replication
    if a.ranks is not None:
        if a.node_rank is not None or a.nproc_per_node is not None:
            raise UsageError("give either --ranks or --node-rank/--nproc-per-node, not both")
        ranks = parse_ranks(a.ranks)
    elif a.nproc_per_node is not None or a.node_rank is not None:
        if a.nproc_per_node is None:
            raise UsageError("--node-rank needs --nproc-per-node")
        node = a.node_rank or 0
        ranks = list(range(node * a.nproc_per_node, min((node + 1) * a.nproc_per_node, world)))
        if not ranks:
            raise UsageError(f"node {node} has no ranks: {node} x {a.nproc_per_node} >= --world-size {world}")
    elif world == 1:
        ranks = [0]
    else:
        raise UsageError("with --world-size > 1, say which ranks run on this node: --ranks 0-7, "
                         "or --node-rank N --nproc-per-node M")
    bad = [r for r in ranks if r >= world]
    if bad:
        raise UsageError(f"--ranks: rank {bad[0]} is not below --world-size {world}")
    if world % k:
        raise UsageError(f"--world-size {world} is not a multiple of --replication {k}")
    return world // k, sorted({r // k for r in ranks}), ranks


def warm_order(counts: np.ndarray, spec: PlanSpec, dp_ranks: Sequence[int]) -> list[int]:
    """The shards this node's consumers need, first need first: every consumer's (data-parallel rank
    in ``dp_ranks``, worker in ``range(spec.num_workers)``) shard sequence for ``spec.epoch``,
    interleaved by node-clock time (``ConsumerPlan.shard_times``), deduplicated."""
    events: list[tuple[float, int, int, int]] = []
    consumer = 0
    for r in dp_ranks:
        for w in range(max(spec.num_workers, 1)):
            plan = build_plan(counts, dataclasses.replace(spec, dp_rank=r, worker_id=w), shards_only=True)
            last, j = None, 0
            for shard, t in plan.shard_times(spec.epoch):
                j = j + 1 if t == last else 0  # shards of one window share its start time: keep run order
                last = t
                events.append((t, j, consumer, shard))
            consumer += 1
    events.sort()
    return list(dict.fromkeys(shard for *_, shard in events))


@dataclass
class _WarmTally:
    fetched: int = 0
    fetched_bytes: int = 0
    cached: int = 0
    not_admitted: list[int] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def cmd_warm(ctx: Ctx) -> int:
    a = ctx.args
    dp_size, dp_ranks, ranks = _node_dp_ranks(a)
    config = ctx.cache_config()
    num_workers = max(a.workers, 1)
    with closing(open_store(a.url, ctx.storage_options)) as store:
        manifest = load_manifest(store)
        counts = np.array([s.samples for s in manifest.shards], dtype=np.int64)
        spec = PlanSpec(seed=a.seed, epoch=a.epoch, shuffle=a.shuffle, window=a.window, drop_last=a.drop_last,
                        dp_size=dp_size, dp_rank=dp_ranks[0], num_workers=num_workers, worker_id=0)
        order = warm_order(counts, spec, dp_ranks)
        with NodeCache(config) as cache:
            if config.policy != "lru":  # evict (and bypass) by next use in the node's plan, as the dataset does
                cache.set_policy(ClairvoyantPolicy(node_schedule(manifest, counts, spec, dp_ranks)))
            return _warm(ctx, store, manifest, cache, order, ranks, dp_ranks)


def _select(manifest: Manifest, cache: NodeCache, order: list[int], a: Any) -> tuple[list[int], list[int], int, str]:
    """Split the longest prefix of ``order`` that fits into (RAM part, SSD part, limit, what limits)."""
    ram_left = cache.ram.budget if cache.ram.enabled else 0
    ssd_left = cache.ssd.budget if cache.ssd.enabled else 0
    limit, why = ram_left + ssd_left, "the cache budgets"
    node_bytes = sum(manifest.shards[s].bytes for s in order)
    if a.bytes is not None and a.bytes < limit:
        limit, why = a.bytes, "--bytes"
    if a.fraction is not None and int(a.fraction * node_bytes) < limit:
        limit, why = int(a.fraction * node_bytes), "--fraction"
    ram, ssd, used = [], [], 0
    for s in order:
        size = manifest.shards[s].bytes
        if used + size > limit:
            break
        if size <= ram_left:
            ram.append(s)
            ram_left -= size
        elif size <= ssd_left:
            ssd.append(s)
            ssd_left -= size
        else:
            break
        used += size
    if len(ram) + len(ssd) == len(order):
        why = ""
    return ram, ssd, limit, why


def _warm(ctx: Ctx, store: Store, manifest: Manifest, cache: NodeCache, order: list[int], ranks: list[int],
          dp_ranks: list[int]) -> int:
    a = ctx.args
    ram_part, ssd_part, limit, limited_by = _select(manifest, cache, order, a)
    selected = ram_part + ssd_part
    size_of = {s: manifest.shards[s].bytes for s in order}
    sel_bytes = sum(size_of[s] for s in selected)
    node_bytes = sum(size_of.values())
    info: dict[str, Any] = {
        "url": store.url, "dataset_id": manifest.dataset_id, "epoch": a.epoch, "ranks": ranks,
        "dp_size": a.world_size // a.replication, "dp_ranks": dp_ranks, "workers": a.workers,
        "node_shards": len(order), "node_bytes": node_bytes, "selected_shards": len(selected),
        "selected_bytes": sel_bytes, "limit_bytes": limit, "limited_by": limited_by or None,
    }
    scope = (f"epoch {a.epoch}, ranks {_fmt_ranks(ranks)} of {a.world_size}"
             + (f" x {a.workers} workers" if a.workers else ""))
    scope_line = (f"  selected {len(selected)} of the {len(order)} shards this node reads "
                  f"({format_size(sel_bytes)} of {format_size(node_bytes)})"
                  + (f", limited by {limited_by}" if limited_by else ""))
    if a.dry_run:
        tiers = {s: "ram" for s in ram_part} | {s: "ssd" for s in ssd_part}
        shards = [{"name": manifest.shards[s].name, "bytes": size_of[s], "tier": tiers[s],
                   "cached": cache.contains(manifest.cache_key(s))} for s in selected]
        cached = sum(1 for s in shards if s["cached"])
        ctx.emit({**info, "dry_run": True, "already_cached": cached, "shards": shards},
                 [f"would warm {store.url} ({manifest.dataset_id}) for {scope}:", scope_line,
                  f"  {cached} of them already cached; {len(ram_part)} for RAM, {len(ssd_part)} for SSD"])
        return 0

    tally, stop = _WarmTally(), threading.Event()
    progress = _Progress(ctx, sel_bytes, "warming", len(selected))
    on_bytes = _watch(stop, progress)

    def one(shard: int) -> None:
        if stop.is_set():
            return
        shard_info = manifest.shards[shard]
        fetched = []

        def fetch(path: str) -> None:
            fetched.append(True)
            store.read_into(shard_info.name, path, size=shard_info.bytes, on_bytes=on_bytes)
        handle = cache.get(manifest.cache_key(shard), fetch, size=shard_info.bytes, hash=shard_info.hash)
        tier = handle.tier
        handle.release()
        with tally.lock:
            if fetched:
                tally.fetched += 1
                tally.fetched_bytes += shard_info.bytes
            else:
                tally.cached += 1
            if tier == "pass":
                tally.not_admitted.append(shard)
        if not fetched:
            progress.add(shard_info.bytes)
        progress.item_done()

    before, t0 = cache.stats(), time.monotonic()
    try:
        # RAM part first, in need order: the cache puts fills into RAM while it has room.
        _run_pool(ram_part, one, a.threads, stop, "datacache-warm")
        retry = tally.not_admitted if cache.ssd.enabled else []
        if retry or ssd_part:
            # A fill the policy does not admit to a full RAM tier is not cached at all, so the SSD
            # part is filled with the RAM tier switched off for this process only (retrying there
            # the RAM part's shards that RAM did not admit, e.g. for lack of unpinned room).
            tally.not_admitted = []
            progress.grow(sum(size_of[s] for s in retry), len(retry))
            ram_on, cache.ram.enabled = cache.ram.enabled, False
            try:
                _run_pool(retry + ssd_part, one, a.threads, stop, "datacache-warm")
            finally:
                cache.ram.enabled = ram_on
    except KeyboardInterrupt:
        progress.close()
        print(f"datacache: interrupted after fetching {tally.fetched} shards "
              f"({format_size(tally.fetched_bytes)}); the cache is consistent", file=sys.stderr)
        raise
    finally:
        progress.close()
        cache.index.flush()
    seconds = time.monotonic() - t0
    after = cache.stats()
    info.update({
        "fetched": tally.fetched, "fetched_bytes": tally.fetched_bytes, "already_cached": tally.cached,
        "not_admitted": len(tally.not_admitted), "seconds": round(seconds, 3),
        "mb_per_s": round(_mbps(tally.fetched_bytes, seconds), 2),
        "fetches": int(after.get("fetches", 0) - before.get("fetches", 0)),
        "remote_bytes": int(after.get("remote_bytes", 0) - before.get("remote_bytes", 0)),
        "used_ram": after["used_ram"], "budget_ram": after["budget_ram"],
        "used_ssd": after["used_ssd"], "budget_ssd": after["budget_ssd"],
    })
    lines = [f"warmed {store.url} ({manifest.dataset_id}) for {scope}:",
             f"  fetched {tally.fetched} shards ({format_size(tally.fetched_bytes)}) in {seconds:.1f} s "
             f"({_mbps(tally.fetched_bytes, seconds):.1f} MB/s); {tally.cached} already cached", scope_line,
             f"  cache: ram {format_size(after['used_ram'])} / {format_size(after['budget_ram'])}, "
             f"ssd {format_size(after['used_ssd'])} / {format_size(after['budget_ssd'])}"]
    if tally.not_admitted:
        lines.append(f"  {len(tally.not_admitted)} shards were fetched but not admitted (no room: entries "
                     f"pinned by running readers, or needed sooner)")
    ctx.emit(info, lines)
    return 0


# --------------------------------------------------------------------------------------- stat
