"""``datacache warm``: fill this node's cache in the order its ranks will read."""
from __future__ import annotations

import dataclasses
import re
import threading
import time
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import format_size
from ..dist import plan_nodes
from ..mixing.source import MixedSource, open_mixed
from ..mixing.streams import load_streams
from ..plan.epoch import PlanSpec
from ..plan.node_share import readonly
from ..progress import Progress
from ..read.node_schedule import node_dp_ranks, node_schedule, warm_order
from ..read.shard_source import ShardSource, tell_plan
from .common import Ctx, UsageError, _fmt_ranks, _mbps, _run_pool, _watch

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


def _node_dp_ranks(a: Any) -> tuple[int, list[int], list[int], int]:
    """(data-parallel size, data-parallel ranks on this node, global ranks on this node, node count
    of the plan)."""
    world, k = a.world_size, a.replication
    per_node = a.nproc_per_node
    if a.nodes is not None:
        if per_node is not None or world % a.nodes:
            raise UsageError(f"--nodes {a.nodes}: give it instead of --nproc-per-node, dividing --world-size {world}")
        per_node = world // a.nodes
    if a.ranks is not None:
        if a.node_rank is not None or per_node is not None:
            raise UsageError("give either --ranks or --node-rank with --nproc-per-node or --nodes, not both")
        ranks = parse_ranks(a.ranks)
    elif per_node is not None or a.node_rank is not None:
        if per_node is None:
            raise UsageError("--node-rank needs --nproc-per-node or --nodes")
        node = a.node_rank or 0
        ranks = list(range(node * per_node, min((node + 1) * per_node, world)))
        if not ranks:
            raise UsageError(f"node {node} has no ranks: {node} x {per_node} >= --world-size {world}")
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
    # The training job's node count: its ranks per node are this node's (an aligned block of ranks).
    block = ranks == list(range(ranks[0], ranks[0] + len(ranks))) and ranks[0] % len(ranks) == 0
    nodes = plan_nodes(world, per_node or len(ranks), k, a.placement) if block or per_node else 1
    return world // k, node_dp_ranks(ranks, k), ranks, nodes


def _open(ctx: Ctx) -> ShardSource | MixedSource:
    """The dataset of ``URL``, or the mix of ``--streams FILE`` (a stream without storage_options
    takes the command's)."""
    a = ctx.args
    if (a.url is None) == (a.streams is None):
        raise UsageError("give a dataset URL or --streams FILE" + (", not both" if a.url else ""))
    if a.url is not None:
        return ShardSource.open(a.url, storage_options=ctx.storage_options, cache=ctx.cache_config())
    try:
        mix = load_streams(a.streams)
        streams = [s if s.storage_options is not None else dataclasses.replace(s, storage_options=ctx.storage_options)
                   for s in mix.pop("streams")]
        return open_mixed(streams, cache=ctx.cache_config(), transfer=None, retry=None, reader_options=None,
                          seed=a.seed, shuffle=a.shuffle, epoch_size=mix.get("epoch_size"),
                          batching=mix.get("batching", "random"), sampling=mix.get("sampling", "balanced"))
    except ValueError as exc:
        raise UsageError(f"--streams {a.streams}: {exc}") from None


def _label(source: ShardSource | MixedSource) -> str:
    return source.label if isinstance(source, MixedSource) else source.store.url


def cmd_warm(ctx: Ctx) -> int:
    a = ctx.args
    dp_size, dp_ranks, ranks, nodes = _node_dp_ranks(a)
    num_workers = max(a.workers, 1)
    with closing(_open(ctx)) as source, source.cache:
        counts = np.array([s.samples for s in source.manifest.shards], dtype=np.int64)
        mix = source.mix if isinstance(source, MixedSource) else None
        composed = mix is not None and mix.layout_bound  # as the dataset plans a composed mix
        spec = PlanSpec(seed=a.seed, epoch=a.epoch, shuffle=a.shuffle and not composed, window=a.window,
                        drop_last=a.drop_last, dp_size=dp_size, dp_rank=dp_ranks[0], num_workers=num_workers,
                        worker_id=0, num_nodes=nodes, batch_size=a.batch_size, placement=a.placement,
                        composed=composed, shard_bytes=readonly([s.bytes for s in source.manifest.shards]))
        # a mix's copies of one shard are one cache entry: warmed once, at its first need
        first: dict[str, int] = {}
        for shard in warm_order(counts, spec, dp_ranks, mix):
            first.setdefault(source.key(shard), shard)
        order = list(first.values())
        # Evict (and bypass) by next use in the node's plan, as the dataset does.
        tell_plan(source.cache, node_schedule(source.manifest, counts, spec, dp_ranks, orders=mix))
        sel = _select(source, order, a)
        info = {"url": _label(source), "dataset_id": source.manifest.dataset_id, "epoch": a.epoch, "ranks": ranks,
                "dp_size": dp_size, "dp_ranks": dp_ranks, "workers": a.workers, "nodes": nodes,
                "node_rank": spec.node, **sel.info()}
        scope = (f"epoch {a.epoch}, ranks {_fmt_ranks(ranks)} of {a.world_size}"
                 + (f" x {a.workers} workers" if a.workers else "")
                 + (f" (node {spec.node} of {nodes}: its share)" if nodes > 1 else ""))
        if a.dry_run:
            return _dry_run(ctx, source, sel, info, scope)
        before, t0 = source.cache.stats(), time.monotonic()
        tally = _fill(ctx, source, sel)
        _report(ctx, source, sel, tally, info, scope, before, time.monotonic() - t0)
        return 0


@dataclass
class _Selection:
    """The part of the node's share that ``warm`` fills: the longest prefix of ``order`` that fits,
    split into what goes to RAM and what to SSD."""

    order: list[int]
    size_of: dict[int, int]
    ram: list[int]
    ssd: list[int]
    limit: int
    limited_by: str

    @property
    def shards(self) -> list[int]:
        return self.ram + self.ssd

    def info(self) -> dict[str, Any]:
        return {"node_shards": len(self.order), "node_bytes": sum(self.size_of.values()),
                "selected_shards": len(self.shards), "selected_bytes": sum(self.size_of[s] for s in self.shards),
                "limit_bytes": self.limit, "limited_by": self.limited_by or None}

    def line(self) -> str:
        i = self.info()
        return (f"  selected {i['selected_shards']} of the {i['node_shards']} shards this node reads "
                f"({format_size(i['selected_bytes'])} of {format_size(i['node_bytes'])})"
                + (f", limited by {self.limited_by}" if self.limited_by else ""))


def _select(source: ShardSource, order: list[int], a: Any) -> _Selection:
    """Split the longest prefix of ``order`` that fits the budgets (and ``--bytes``/``--fraction``)."""
    size_of = {s: source.manifest.shards[s].bytes for s in order}
    budgets = source.cache.budgets()
    ram_left, ssd_left = budgets["ram"], budgets["ssd"]
    limit, why = ram_left + ssd_left, "the cache budgets"
    node_bytes = sum(size_of.values())
    if a.bytes is not None and a.bytes < limit:
        limit, why = a.bytes, "--bytes"
    if a.fraction is not None and int(a.fraction * node_bytes) < limit:
        limit, why = int(a.fraction * node_bytes), "--fraction"
    ram, ssd, used = [], [], 0
    for s in order:
        size = size_of[s]
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
    return _Selection(order, size_of, ram, ssd, limit, "" if len(ram) + len(ssd) == len(order) else why)


def _dry_run(ctx: Ctx, source: ShardSource, sel: _Selection, info: dict[str, Any], scope: str) -> int:
    tiers = {s: "ram" for s in sel.ram} | {s: "ssd" for s in sel.ssd}
    shards = [{"name": source.manifest.shards[s].name, "bytes": sel.size_of[s], "tier": tiers[s],
               "cached": source.cache.contains(source.key(s))} for s in sel.shards]
    cached = sum(1 for s in shards if s["cached"])
    ctx.emit({**info, "dry_run": True, "already_cached": cached, "shards": shards},
             [f"would warm {_label(source)} ({source.manifest.dataset_id}) for {scope}:", sel.line(),
              f"  {cached} of them already cached; {len(sel.ram)} for RAM, {len(sel.ssd)} for SSD"])
    return 0


@dataclass
class _WarmTally:
    fetched: int = 0
    fetched_bytes: int = 0
    cached: int = 0
    not_admitted: list[int] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def _fill(ctx: Ctx, source: ShardSource, sel: _Selection) -> _WarmTally:
    """Fetch the selection through the cache on ``--threads`` threads: the RAM part first, in need
    order (the cache fills RAM while it has room), then the SSD part into SSD. Ctrl-C stops it
    with the cache consistent."""
    a = ctx.args
    tally, stop = _WarmTally(), threading.Event()
    progress = Progress(ctx.quiet, sum(sel.size_of[s] for s in sel.shards), "warming", len(sel.shards))
    on_bytes = _watch(stop, progress)

    def one(shard: int, into: str | None) -> None:
        if stop.is_set():
            return
        fetched: list[bool] = []
        with source.fetch(shard, into=into, on_bytes=on_bytes, on_fetch=lambda: fetched.append(True),
                          cancelled=stop.is_set) as handle:
            tier = handle.tier
        size = sel.size_of[shard]
        with tally.lock:
            if fetched:
                tally.fetched += 1
                tally.fetched_bytes += size
            else:
                tally.cached += 1
            if tier == "pass":
                tally.not_admitted.append(shard)
        if not fetched:
            progress.add(size)
        progress.item_done()

    try:
        _run_pool(sel.ram, lambda s: one(s, None), a.threads, stop, "datacache-warm")
        # A fill the policy does not admit to a full RAM tier is not cached at all: the SSD part
        # goes straight into SSD, with the RAM part's shards that RAM did not admit (e.g. for lack
        # of unpinned room).
        retry = tally.not_admitted if source.cache.budgets()["ssd"] else []
        if retry or sel.ssd:
            tally.not_admitted = []
            progress.grow(sum(sel.size_of[s] for s in retry), len(retry))
            _run_pool(retry + sel.ssd, lambda s: one(s, "ssd"), a.threads, stop, "datacache-warm")
    except KeyboardInterrupt:  # reported once, by cli.main, with this detail
        raise KeyboardInterrupt(f"after fetching {tally.fetched} shards ({format_size(tally.fetched_bytes)}); "
                                "the cache is consistent") from None
    finally:
        progress.close()
        source.cache.flush_stats()
    return tally


def _report(ctx: Ctx, source: ShardSource, sel: _Selection, tally: _WarmTally, info: dict[str, Any], scope: str,
            before: dict[str, Any], seconds: float) -> None:
    after = source.cache.stats()
    info.update({
        "fetched": tally.fetched, "fetched_bytes": tally.fetched_bytes, "already_cached": tally.cached,
        "not_admitted": len(tally.not_admitted), "seconds": round(seconds, 3),
        "mb_per_s": round(_mbps(tally.fetched_bytes, seconds), 2),
        "fetches": int(after.get("fetches", 0) - before.get("fetches", 0)),
        "remote_bytes": int(after.get("remote_bytes", 0) - before.get("remote_bytes", 0)),
        "used_ram": after["used_ram"], "budget_ram": after["budget_ram"],
        "used_ssd": after["used_ssd"], "budget_ssd": after["budget_ssd"],
    })
    lines = [f"warmed {_label(source)} ({source.manifest.dataset_id}) for {scope}:",
             f"  fetched {tally.fetched} shards ({format_size(tally.fetched_bytes)}) in {seconds:.1f} s "
             f"({_mbps(tally.fetched_bytes, seconds):.1f} MB/s); {tally.cached} already cached", sel.line(),
             f"  cache: ram {format_size(after['used_ram'])} / {format_size(after['budget_ram'])}, "
             f"ssd {format_size(after['used_ssd'])} / {format_size(after['budget_ssd'])}"]
    if tally.not_admitted:
        lines.append(f"  {len(tally.not_admitted)} shards were fetched but not admitted (no room: entries "
                     f"pinned by running readers, or needed sooner)")
    ctx.emit(info, lines)
