"""The subcommands of the ``datacache`` command line (the parser and exit codes are in ``cli``).

Each ``cmd_*`` takes a :class:`Ctx` and returns an exit code (0, or 1 for a verification mismatch);
errors are raised (``UsageError`` -> 2, ``DatacacheError``/``ReaderError``/``OSError`` -> 3,
``KeyboardInterrupt`` -> 130) and reported by ``cli.main``. Progress bars go to stderr, results
(text or ``--json``) to stdout.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable
from contextlib import closing
from typing import Any

import numpy as np

from .._localfs import try_pin, unlock_close
from ..cache.node import NodeCache
from ..config import CacheConfig, format_size
from ..errors import IntegrityError, NotFoundError
from ..hashing import Hasher
from ..manifest import Manifest, ShardInfo, load_manifest
from ..plan.node_assign import assign_nodes
from ..progress import Progress
from ..store.congestion import node_states
from ..store.storage import Store, open_store
from .common import _CHUNK, Ctx, UsageError, _download, _run_pool, _watch
from .data import cmd_index, cmd_write
from .warm import cmd_warm, parse_ranks, warm_order

__all__ = ["Ctx", "UsageError", "COMMANDS", "warm_order", "parse_ranks"]


def cmd_stat(ctx: Ctx) -> int:
    config = ctx.cache_config()
    manifest = _share_manifest(ctx)
    with NodeCache(config) as cache:
        s = cache.stats()
        entries = cache.entries()
        stores = node_states(cache.control_dir)
        pinned = cache.pinned()
    datasets: dict[str, dict[str, int]] = {}
    for key, e in entries:
        d = datasets.setdefault(key.split("/", 1)[0], {"entries": 0, "bytes": 0, "ram_entries": 0, "ram_bytes": 0,
                                                         "ssd_entries": 0, "ssd_bytes": 0})
        d["entries"] += 1
        d["bytes"] += e.size
        for t in e.tiers:
            d[f"{t}_entries"] += 1
            d[f"{t}_bytes"] += e.size
    misses = {"ram": s.get("hits_ssd", 0) + s.get("misses", 0), "ssd": s.get("misses", 0)}
    tiers = {t: {"dir": getattr(config, f"{t}_dir"), "budget": s[f"budget_{t}"], "used": s[f"used_{t}"],
                 "entries": s[f"entries_{t}"], "hits": s.get(f"hits_{t}", 0), "misses": misses[t],
                 "evictions": s.get(f"evictions_{t}", 0)} for t in ("ram", "ssd")}
    data = {"tiers": tiers, "remote_bytes": s.get("remote_bytes", 0), "fetches": s.get("fetches", 0),
            "fetch_seconds": round(float(s.get("fetch_seconds", 0.0)), 3), "datasets": datasets, "counters": s,
            "stores": stores, "pinned": pinned}
    lines = [f"{'tier':<5} {'budget':>10} {'used':>10} {'entries':>8} {'hits':>8} {'misses':>8}  dir"]
    for t, v in tiers.items():
        budget = format_size(v["budget"]) if v["budget"] else "off"
        lines.append(f"{t:<5} {budget:>10} {format_size(v['used']):>10} {v['entries']:>8} {v['hits']:>8} "
                     f"{v['misses']:>8}  {v['dir']}")
    lines.append("pinned: " + ("unknown here (no /proc/locks)" if pinned is None else ", ".join(
        f"{t} {v['entries']} entries {format_size(v['bytes'])}" for t, v in pinned.items())))
    lines.append(f"remote: {format_size(data['remote_bytes'])} in {data['fetches']} fetches "
                 f"({data['fetch_seconds']:.1f} s)")
    for st in stores:  # the node's congestion state per store prefix (datacache.store.congestion)
        lines.append(f"store {st['url']}: concurrency {st['concurrency']}, {st['requests']} requests, "
                     f"{st['throttled']} throttled, {st['throttle_seconds']:.1f} s throttled"
                     f"{' (backing off now)' if st['backing_off'] else ''}")
    lines.append(f"datasets: {len(datasets) or 'none'}")
    for ds, d in sorted(datasets.items()):
        lines.append(f"  {ds}  {d['entries']} entries  {format_size(d['bytes'])}  "
                     f"(ram {format_size(d['ram_bytes'])}, ssd {format_size(d['ssd_bytes'])})")
    if manifest is not None:
        a = ctx.args
        share = _node_share(manifest, a.nodes, a.node_rank or 0, a.seed, {k for k, _ in entries})
        data["node_share"] = {"url": a.url, **share}
        part = share["cached_bytes"] / share["bytes"] if share["bytes"] else 1.0
        lines.append(f"node {share['node_rank']} of {a.nodes} (seed {a.seed}) of {a.url}: "
                     f"share {share['shards']} shards, {format_size(share['bytes'])}; "
                     f"cached {share['cached_shards']} shards, {format_size(share['cached_bytes'])} ({part:.0%})")
    ctx.emit(data, lines)
    return 0


def _share_manifest(ctx: Ctx) -> Manifest | None:
    """The manifest of ``stat URL --nodes N``'s dataset (None without ``--nodes``)."""
    a = ctx.args
    if a.nodes is None:
        if a.node_rank is not None or a.url is not None:
            raise UsageError("stat URL needs --nodes N (and --node-rank K): the node's share of a job on N nodes")
        return None
    if a.url is None:
        raise UsageError("stat --nodes needs the dataset: datacache stat URL --nodes N --node-rank K")
    if (a.node_rank or 0) >= a.nodes:
        raise UsageError(f"--node-rank {a.node_rank} is not below --nodes {a.nodes}")
    with closing(open_store(a.url, ctx.storage_options)) as store:
        return load_manifest(store)


def _node_share(m: Manifest, nodes: int, node: int, seed: int, cached: set[str]) -> dict[str, Any]:
    """Node ``node``'s share of ``m`` in a ``nodes``-node job, and how much of it is in ``cached``."""
    owner = assign_nodes(np.array([s.bytes for s in m.shards], dtype=np.int64), nodes, seed)
    held = [s for s in np.flatnonzero(owner == node).tolist() if m.cache_key(s) in cached]
    share = _node_shares(m, nodes, seed)[node]
    return {"dataset_id": m.dataset_id, "nodes": nodes, "node_rank": node, "seed": seed, "shards": share["shards"],
            "bytes": share["bytes"], "cached_shards": len(held), "cached_bytes": sum(m.shards[s].bytes for s in held)}


# ----------------------------------------------------------------------------------------- ls
def cmd_ls(ctx: Ctx) -> int:
    a = ctx.args
    with closing(open_store(a.url, ctx.storage_options)) as store:
        m = load_manifest(store)
    data: dict[str, Any] = {"url": store.url, "dataset_id": m.dataset_id, "format": m.format, "schema": m.schema,
                            "num_shards": len(m.shards), "num_samples": m.num_samples, "total_bytes": m.total_bytes,
                            "format_version": m.format_version, "extra": m.extra}
    lines = [store.url,
             f"  dataset id  {m.dataset_id}",
             f"  format      {m.format}",
             f"  shards      {len(m.shards):,}",
             f"  samples     {m.num_samples:,}",
             f"  bytes       {format_size(m.total_bytes)} ({m.total_bytes:,})",
             f"  schema      {json.dumps(m.schema)}"]
    if a.nodes:
        data["nodes"] = _node_shares(m, a.nodes, a.seed)
        shares = [n["bytes"] for n in data["nodes"]]
        lines.append(f"  nodes       {a.nodes}: {format_size(min(shares))} to {format_size(max(shares))} a node "
                     f"(seed {a.seed}; the shards each node keeps for the run)")
    if a.shards:
        data["shards"] = [s.to_dict() for s in m.shards]
        width = max((len(s.name) for s in m.shards), default=4)
        lines += [f"  {s.name:<{width}}  {s.bytes:>12,} B  {s.samples:>9,} samples  {s.hash}" for s in m.shards]
    ctx.emit(data, lines)
    return 0


def _node_shares(m: Manifest, nodes: int, seed: int) -> list[dict[str, int]]:
    """Each node's share of the dataset in a ``nodes``-node job (``datacache.plan.epoch.node_assign.assign_nodes``)."""
    sizes = np.array([s.bytes for s in m.shards], dtype=np.int64)
    owner = assign_nodes(sizes, nodes, seed)
    per_bytes = np.bincount(owner, weights=sizes, minlength=nodes)  # exact below 2**53 bytes
    per_shards = np.bincount(owner, minlength=nodes)
    return [{"node": k, "shards": int(per_shards[k]), "bytes": int(per_bytes[k])} for k in range(nodes)]


# -------------------------------------------------------------------------------------- verify


def _hash_fd(fd: int, progress: Progress | None) -> tuple[int, str]:
    h, off = Hasher(), 0
    while True:
        chunk = os.pread(fd, _CHUNK, off)
        if not chunk:
            return off, h.hexdigest()
        h.update(chunk)
        off += len(chunk)
        if progress is not None:
            progress.add(len(chunk))


def _verify_cached(ctx: Ctx, manifest: Manifest, mismatches: list[dict[str, Any]]) -> int:
    by_name = {s.name: s for s in manifest.shards}
    prefix = manifest.dataset_id + "/"
    checked = 0
    with NodeCache(ctx.cache_config()) as cache:
        files = cache.entry_files(prefix)
        progress = Progress(ctx.quiet, sum(e.size for _, e, _, _ in files), "verifying cache", len(files), "files")
        try:
            for key, _, tier, path in files:
                fd = try_pin(path)
                if fd is None:  # evicted meanwhile
                    continue
                try:
                    size, digest = _hash_fd(fd, progress)
                finally:
                    unlock_close(fd)
                checked += 1
                progress.item_done()
                name = key[len(prefix):]
                info = by_name.get(name)
                problem = None
                if info is None:
                    problem = "not a shard of this manifest"
                elif size != info.bytes:
                    problem = f"size {size} != manifest {info.bytes}"
                elif digest != info.hash:
                    problem = f"content hash {digest} != manifest {info.hash}"
                if problem:
                    mismatches.append({"where": tier, "shard": name, "key": key, "path": path, "problem": problem})
        finally:
            progress.close()
    return checked


def _verify_remote(ctx: Ctx, store: Store, manifest: Manifest, mismatches: list[dict[str, Any]]) -> int:
    stop, lock = threading.Event(), threading.Lock()
    progress = Progress(ctx.quiet, manifest.total_bytes, "verifying remote", len(manifest.shards), "objects")
    on_bytes = _watch(stop, progress)

    def one(info: ShardInfo, tmpdir: str) -> None:
        if stop.is_set():
            return
        problem = None
        try:
            path, digest = _download(store, info.name, info.bytes, tmpdir, on_bytes, stop.is_set)
            os.unlink(path)
            if digest != info.hash:
                problem = f"content hash {digest} != manifest {info.hash}"
        except NotFoundError:
            problem = "missing"
        except IntegrityError as exc:  # larger or smaller than the manifest says
            problem = str(exc).replace(store.url_of(info.name) + ": ", "")
        if problem:
            with lock:
                mismatches.append({"where": "remote", "shard": info.name, "url": store.url_of(info.name),
                                   "problem": problem})
        progress.item_done()
    try:
        with tempfile.TemporaryDirectory(prefix="datacache-verify-") as tmpdir:
            _run_pool(list(manifest.shards), lambda info: one(info, tmpdir), ctx.args.threads, stop,
                      "datacache-verify")
    finally:
        progress.close()
    return len(manifest.shards)


def cmd_verify(ctx: Ctx) -> int:
    a = ctx.args
    mismatches: list[dict[str, Any]] = []
    checked = {"cached": 0, "remote": 0}
    with closing(open_store(a.url, ctx.storage_options)) as store:
        manifest = load_manifest(store)
        if not a.remote_only:
            checked["cached"] = _verify_cached(ctx, manifest, mismatches)
        if not a.cached_only:
            checked["remote"] = _verify_remote(ctx, store, manifest, mismatches)
    order = {s.name: i for i, s in enumerate(manifest.shards)}
    mismatches.sort(key=lambda m: (m["where"], order.get(m["shard"], -1)))
    what = " and ".join(f"{checked[k]} {k} {'files' if k == 'cached' else 'objects'}" for k in ("remote", "cached")
                        if not (k == "remote" and a.cached_only) and not (k == "cached" and a.remote_only))
    lines = [f"MISMATCH {m['where']:<6} {m['shard']}: {m['problem']}"
             + (f" ({m['path']})" if "path" in m else "") for m in mismatches]
    lines.append(f"{'FAILED' if mismatches else 'OK'}: {store.url} ({manifest.dataset_id}): {what} checked, "
                 f"{len(mismatches)} mismatch{'es' if len(mismatches) != 1 else ''}")
    ctx.emit({"url": store.url, "dataset_id": manifest.dataset_id, "ok": not mismatches, "checked": checked,
              "mismatches": mismatches}, lines)
    return 1 if mismatches else 0


# -------------------------------------------------------------------------------------- clear
def cmd_clear(ctx: Ctx) -> int:
    a = ctx.args
    tiers = tuple(t for t, on in (("ram", a.ram), ("ssd", a.ssd)) if on) or ("ram", "ssd")
    config = ctx.cache_config()
    with NodeCache(config) as cache:
        if a.dataset is not None:
            _check_cached_dataset(a.dataset, cache, config)
        removed = cache.clear(tiers=tiers, dataset=a.dataset)
        left = sum(1 for key, e in cache.entries() for t in e.tiers
                   if t in tiers and (a.dataset is None or key.startswith(a.dataset + "/")))
        s = cache.stats()
    scope = f"dataset {a.dataset}" if a.dataset else "all datasets"
    lines = [f"removed {removed} cached files from {' and '.join(tiers)} ({scope})"]
    if left:
        lines.append(f"  {left} files in use by readers were kept")
    ctx.emit({"removed": removed, "kept_in_use": left, "tiers": list(tiers), "dataset": a.dataset,
              "used_ram": s["used_ram"], "used_ssd": s["used_ssd"]}, lines)
    return 0


def _check_cached_dataset(dataset: str, cache: NodeCache, config: CacheConfig) -> None:
    """UsageError naming ``dataset`` when the cache holds no entry of it (a typo, or another cache)."""
    known = sorted({key.split("/", 1)[0] for key, _ in cache.entries()})
    if dataset in known:
        return
    listed = ", ".join(known[:3]) + (", ..." if len(known) > 3 else "") if known else "none"
    raise UsageError(f"--dataset {dataset}: no such dataset in the cache at {config.ram_dir} and {config.ssd_dir} "
                     f"(cached: {listed}); `datacache stat` lists the cached dataset ids")


COMMANDS: dict[str, Callable[[Ctx], int]] = {
    "warm": cmd_warm, "stat": cmd_stat, "ls": cmd_ls, "index": cmd_index, "write": cmd_write,
    "verify": cmd_verify, "clear": cmd_clear,
}
