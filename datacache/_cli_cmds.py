"""The subcommands of the ``datacache`` command line (the parser and exit codes are in ``cli``).

Each ``cmd_*`` takes a :class:`Ctx` and returns an exit code (0, or 1 for a verification mismatch);
errors are raised (``UsageError`` -> 2, ``DatacacheError``/``ReaderError``/``OSError`` -> 3,
``KeyboardInterrupt`` -> 130) and reported by ``cli.main``. Progress bars go to stderr, results
(text or ``--json``) to stdout.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import io
import json
import os
import re
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

import readers
from readers import codec

from . import __version__
from ._consumer import node_schedule
from .cache import NodeCache
from .config import CacheConfig, format_size
from .errors import DatacacheError, IntegrityError, ManifestError, NotFoundError
from .errors import ReaderError as DcReaderError
from .eviction import ClairvoyantPolicy
from .hashing import Hasher, hash_file
from .manifest import MANIFEST_NAME, Manifest, ShardInfo, load_manifest, validate_shard_name
from .plan import PlanSpec, build_plan
from .storage import Store, open_store
from .tiers import try_pin, unlock_close
from .writer import DatasetWriter

__all__ = ["Ctx", "UsageError", "COMMANDS", "warm_order", "parse_ranks"]

_CHUNK = 8 << 20


class UsageError(ValueError):
    """A bad command line: reported with the usage line, exit code 2."""


class _Stopped(Exception):
    """Raised inside a transfer callback to abandon it (Ctrl-C or another task failed)."""


@dataclass
class Ctx:
    """What every subcommand gets: the parsed arguments and the resolved global settings."""

    args: Any
    json: bool
    quiet: bool
    debug: bool
    cache_config: Callable[[], CacheConfig]
    storage_options: dict[str, Any]

    def emit(self, data: dict[str, Any], lines: Iterable[str]) -> None:
        if self.json:
            print(json.dumps(data, indent=1))
        else:
            for line in lines:
                print(line)
        sys.stdout.flush()


# ------------------------------------------------------------------------------------ helpers
class _Progress:
    """A thread-safe tqdm byte bar (MB, MB/s, ETA) with an item counter as postfix."""

    def __init__(self, ctx: Ctx, total: int, desc: str, items: int, noun: str = "shards") -> None:
        self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000,
                         disable=ctx.quiet, file=sys.stderr, dynamic_ncols=True, leave=False)
        self._lock = threading.Lock()
        self.items, self.done, self.noun = items, 0, noun
        self._postfix()

    def _postfix(self) -> None:
        self._bar.set_postfix_str(f"{self.done}/{self.items} {self.noun}", refresh=False)

    def add(self, n: int) -> None:
        with self._lock:
            self._bar.update(n)

    def item_done(self) -> None:
        with self._lock:
            self.done += 1
            self._postfix()
            self._bar.refresh()

    def grow(self, nbytes: int, items: int = 1) -> None:
        with self._lock:
            self._bar.total = (self._bar.total or 0) + nbytes
            self.items += items
            self._postfix()

    def close(self) -> None:
        self._bar.close()


def _run_pool(items: Sequence[Any], fn: Callable[[Any], None], threads: int, stop: threading.Event,
              name: str) -> None:
    """``fn(item)`` for every item on a thread pool, started in order. The first error (or Ctrl-C in
    the main thread) sets ``stop``, cancels what has not started, waits for the running tasks (which
    watch ``stop`` and abandon their transfer within one part) and is re-raised."""
    if not items:
        return
    pool = ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix=name)
    futures = []
    try:
        futures = [pool.submit(fn, item) for item in items]
        for f in as_completed(futures):
            f.result()
    except BaseException:
        stop.set()
        raise
    finally:
        for f in futures:
            f.cancel()
        pool.shutdown(wait=True)


def _watch(stop: threading.Event, progress: _Progress | None) -> Callable[[int], None]:
    def on_bytes(n: int) -> None:
        if stop.is_set():
            raise _Stopped()
        if progress is not None:
            progress.add(n)
    return on_bytes


def _download(store: Store, name: str, size: int, tmpdir: str, on_bytes: Callable[[int], None]) -> tuple[str, str]:
    """Read object ``name`` into a temporary file under ``tmpdir``; returns (path, content hash)."""
    fd, path = tempfile.mkstemp(dir=tmpdir, prefix=".dl-")
    os.close(fd)
    try:
        store.read_into(name, path, size=size, on_bytes=on_bytes)
        return path, hash_file(path)
    except BaseException:
        os.unlink(path)
        raise


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / 1e6 / seconds if seconds > 0 else 0.0


def _fmt_ranks(ranks: Sequence[int]) -> str:
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


# --------------------------------------------------------------------------------------- warm
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
def cmd_stat(ctx: Ctx) -> int:
    config = ctx.cache_config()
    with NodeCache(config) as cache:
        s = cache.stats()
        entries = cache.entries()
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
            "fetch_seconds": round(float(s.get("fetch_seconds", 0.0)), 3), "datasets": datasets, "counters": s}
    lines = [f"{'tier':<5} {'budget':>10} {'used':>10} {'entries':>8} {'hits':>8} {'misses':>8}  dir"]
    for t, v in tiers.items():
        budget = format_size(v["budget"]) if v["budget"] else "off"
        lines.append(f"{t:<5} {budget:>10} {format_size(v['used']):>10} {v['entries']:>8} {v['hits']:>8} "
                     f"{v['misses']:>8}  {v['dir']}")
    lines.append(f"remote: {format_size(data['remote_bytes'])} in {data['fetches']} fetches "
                 f"({data['fetch_seconds']:.1f} s)")
    lines.append(f"datasets: {len(datasets) or 'none'}")
    for ds, d in sorted(datasets.items()):
        lines.append(f"  {ds}  {d['entries']} entries  {format_size(d['bytes'])}  "
                     f"(ram {format_size(d['ram_bytes'])}, ssd {format_size(d['ssd_bytes'])})")
    ctx.emit(data, lines)
    return 0


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
    if a.shards:
        data["shards"] = [s.to_dict() for s in m.shards]
        width = max((len(s.name) for s in m.shards), default=4)
        lines += [f"  {s.name:<{width}}  {s.bytes:>12,} B  {s.samples:>9,} samples  {s.hash}" for s in m.shards]
    ctx.emit(data, lines)
    return 0


# -------------------------------------------------------------------------------------- index
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$", re.DOTALL)  # as readers.tar groups members
_FOOTER_TAIL = 64 << 10


class _RangeFile(io.RawIOBase):
    """A read-only file over one object, served by range reads; the last 64 KiB are read once up
    front (a Parquet footer usually fits, so reading the metadata costs one request)."""

    def __init__(self, store: Store, name: str, size: int) -> None:
        super().__init__()
        self._store, self._name, self._size, self._pos = store, name, size, 0
        self._tail_start = max(0, size - _FOOTER_TAIL)
        self.tail = store.read_range(name, self._tail_start, size)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, {0: 0, 1: self._pos, 2: self._size}[whence] + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        if end <= self._pos:
            return b""
        if self._pos >= self._tail_start:
            data = self.tail[self._pos - self._tail_start:end - self._tail_start]
        else:
            data = self._store.read_range(self._name, self._pos, end)
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def _arrow_kind(dtype: Any) -> str:
    import pyarrow as pa

    if pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype) or pa.types.is_fixed_size_binary(dtype):
        return "bytes"
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return "str"
    if pa.types.is_integer(dtype):
        return "int"
    return "float" if pa.types.is_floating(dtype) else "any"


def _parquet_footer(store: Store, name: str, size: int) -> tuple[int, dict[str, str]]:
    """(rows, schema) of a Parquet object from its footer alone (range reads)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from readers.parquet import SCHEMA_KEY

    url = store.url_of(name)
    hint = "Check --format and --pattern"
    if size < 12:
        raise DcReaderError(f"not a parquet file ({size} bytes)", url=url, hint=hint)
    f = _RangeFile(store, name, size)
    if f.tail[-4:] != b"PAR1":
        raise DcReaderError("not a parquet file (no PAR1 magic at the end)", url=url, hint=hint)
    try:
        md = pq.read_metadata(f)
        stored = (md.metadata or {}).get(SCHEMA_KEY)
        schema = codec.schema_from_json(stored, url) if stored is not None else \
            {field.name: _arrow_kind(field.type) for field in md.schema.to_arrow_schema()}
    except DatacacheError:
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DcReaderError(f"cannot parse the parquet footer ({exc})", url=url, hint=hint) from None
    return int(md.num_rows), schema


def _tar_probe(store: Store, name: str, size: int) -> None:
    """Fail fast on an object that does not start with a tar header (one 512-byte range read)."""
    head = store.read_range(name, 0, min(512, size))
    try:
        tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
    except tarfile.EOFHeaderError:  # an empty archive
        pass
    except tarfile.HeaderError as exc:
        raise DcReaderError(f"not a tar file ({exc})", url=store.url_of(name),
                            hint="Check --format and --pattern") from None


def _local_count(fmt: str, path: str, url: str) -> tuple[int, dict[str, str]]:
    """(samples, schema) of a local tar or lmdb file, exactly as the dataset's reader will see it."""
    try:
        with readers.open_shard(fmt, path) as r:
            n, schema = len(r), dict(r.schema) if r.schema else None
        if schema is None:  # a plain WebDataset tar: one bytes field per member extension
            schema = {}
            with tarfile.open(path, "r:") as tf:
                for m in tf:
                    match = _KEY_RE.match(m.name) if m.isfile() else None
                    if match:
                        schema.setdefault(match.group(2), "bytes")
    except (readers.ReaderError, tarfile.TarError) as exc:
        raise DcReaderError(f"cannot read as {fmt}: {str(exc).replace(path, 'file')}", url=url,
                            hint="Check --format and --pattern") from None
    return n, schema


def _merge_schemas(fmt: str, schemas: list[tuple[str, dict[str, str]]], store: Store) -> dict[str, str]:
    if not schemas:
        return {}
    first_name, merged = schemas[0][0], dict(schemas[0][1])
    for name, schema in schemas[1:]:
        if fmt == "tar":  # WebDataset samples may lack some fields: the union
            for k, v in schema.items():
                if merged.setdefault(k, v) != v:
                    raise ManifestError(f"field {k!r} is {v!r} here but {merged[k]!r} in {first_name}",
                                        url=store.url_of(name), hint="All shards of a dataset need one schema")
        elif schema != merged:
            raise ManifestError(f"schema {json.dumps(schema)} differs from {json.dumps(merged)} in {first_name}",
                                url=store.url_of(name), hint="All shards of a dataset need one schema; "
                                "use --pattern to index the files of one table")
    return merged


def cmd_index(ctx: Ctx) -> int:
    a = ctx.args
    fmt = a.format
    pattern = a.pattern or f"*{readers.get_format(fmt).extension}"
    with closing(open_store(a.url, ctx.storage_options)) as store:
        if not a.force and store.exists(MANIFEST_NAME):
            raise UsageError(f"{store.url_of(MANIFEST_NAME)} already exists; pass --force to replace it")
        objects = [(n, s) for n, s in store.list() if n != MANIFEST_NAME and fnmatch.fnmatchcase(n, pattern)]
        if not objects:
            raise NotFoundError(f"no objects match {pattern!r} under this prefix", url=store.url,
                                hint="Check the URL and --pattern")
        for n, _ in objects:
            validate_shard_name(n, store.url_of(n))
        total = sum(s for _, s in objects)
        t0, stop = time.monotonic(), threading.Event()
        counts: dict[str, tuple[int, dict[str, str]]] = {}
        hashes: dict[str, str] = {}

        # 1. cheap checks first: Parquet footers (row counts, schema), tar first headers.
        def probe(item: tuple[str, int]) -> None:
            if stop.is_set():
                return
            name, size = item
            if fmt == "parquet":
                counts[name] = _parquet_footer(store, name, size)
            elif fmt == "tar":
                _tar_probe(store, name, size)
        if fmt != "lmdb":
            _run_pool(objects, probe, a.threads, stop, "datacache-index")

        # 2. hash every object (and count tar/lmdb samples in the local copy hashing makes).
        progress = _Progress(ctx, total, "hashing", len(objects), "objects")
        on_bytes = _watch(stop, progress)

        def digest(item: tuple[str, int], tmpdir: str) -> None:
            if stop.is_set():
                return
            name, size = item
            path, h = _download(store, name, size, tmpdir, on_bytes)
            try:
                if fmt != "parquet":
                    counts[name] = _local_count(fmt, path, store.url_of(name))
            finally:
                os.unlink(path)
            hashes[name] = h
            progress.item_done()
        try:
            with tempfile.TemporaryDirectory(prefix="datacache-index-") as tmpdir:
                _run_pool(objects, lambda item: digest(item, tmpdir), a.threads, stop, "datacache-index")
        finally:
            progress.close()
        schema = _merge_schemas(fmt, [(n, counts[n][1]) for n, _ in objects], store)
        shards = tuple(ShardInfo(n, s, counts[n][0], hashes[n]) for n, s in objects)
        manifest = Manifest(format=fmt, schema=schema, shards=shards,
                            extra={"indexed_by": f"datacache {__version__}", "pattern": pattern})
        store.write_bytes(MANIFEST_NAME, manifest.to_json().encode())
        url = store.url_of(MANIFEST_NAME)
    seconds = time.monotonic() - t0
    ctx.emit({"url": url, "dataset_id": manifest.dataset_id, "format": fmt, "schema": schema,
              "num_shards": len(shards), "num_samples": manifest.num_samples, "total_bytes": total,
              "seconds": round(seconds, 3)},
             [f"wrote {url}: {len(shards)} {fmt} shards, {manifest.num_samples:,} samples, {format_size(total)} "
              f"(read once to hash, {_mbps(total, seconds):.1f} MB/s)",
              f"  dataset id  {manifest.dataset_id}", f"  schema      {json.dumps(schema)}"])
    return 0


# -------------------------------------------------------------------------------------- write
def _normalize(sample: dict[str, Any], where: str, src: str) -> dict[str, Any]:
    """JSON/Arrow values -> datacache field values: bool -> int, list/dict -> JSON text."""
    out: dict[str, Any] = {}
    for k, v in sample.items():
        if v is None:
            raise DatacacheError(f"{where}: field {k!r} is null; datacache fields cannot be null", url=src,
                                 hint="Fill or drop null values first")
        if isinstance(v, bool):
            v = int(v)
        elif isinstance(v, (list, dict)):
            v = json.dumps(v, default=str)
        elif not isinstance(v, (bytes, str, int, float, np.ndarray, np.integer, np.floating)):
            v = str(v)  # dates, decimals...
        out[str(k)] = v
    return out


def _src_type(src: str, explicit: str) -> str:
    if explicit != "auto":
        return explicit
    if "://" in src:
        return "dataset"
    if os.path.isdir(src):
        return "dataset" if os.path.isfile(os.path.join(src, MANIFEST_NAME)) else "folder"
    if not os.path.exists(src):
        raise DatacacheError("no such file or directory", url=src)
    low = src.lower()
    if low.endswith((".parquet", ".pq")):
        return "parquet"
    if low.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    raise UsageError(f"cannot tell what {src} is (not a folder, .parquet or .jsonl); use --src-type")


def _folder_samples(root: str, group: bool) -> Iterator[dict[str, Any]]:
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        files += [os.path.relpath(os.path.join(d, n), root) for n in names if not n.startswith(".")]
    if not group:
        for rel in sorted(files):
            with open(os.path.join(root, rel), "rb") as f:
                yield {"__key__": rel, "data": f.read()}
        return
    items = []
    for rel in files:
        d, base = os.path.split(rel)
        if "." in base:  # no extension: skipped, as WebDataset does
            stem, ext = base.split(".", 1)
            items.append((os.path.join(d, stem), ext, rel))
    sample: dict[str, Any] = {}
    for key, ext, rel in sorted(items):
        if sample and sample["__key__"] != key:
            yield sample
            sample = {}
        sample.setdefault("__key__", key)
        with open(os.path.join(root, rel), "rb") as f:
            sample[ext] = f.read()
    if sample:
        yield sample


def _jsonl_samples(path: str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise DatacacheError(f"line {lineno} is not valid JSON ({exc})", url=path) from None
            if not isinstance(obj, dict):
                raise DatacacheError(f"line {lineno} is not a JSON object", url=path)
            yield _normalize(obj, f"line {lineno}", path)


def _parquet_samples(path: str) -> Iterator[dict[str, Any]]:
    with readers.open_shard("parquet", path) as r:
        for i, row in enumerate(r):
            yield _normalize(row, f"row {i}", path)


def _dataset_samples(url: str, storage_options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    with closing(open_store(url, storage_options)) as store:
        m = load_manifest(store)
        fmt = readers.get_format(m.format)
        with tempfile.TemporaryDirectory(prefix="datacache-write-src-") as tmpdir:
            for info in m.shards:
                path, h = _download(store, info.name, info.bytes, tmpdir, lambda n: None)
                try:
                    if h != info.hash:
                        raise IntegrityError(f"content hash {h} != manifest {info.hash}", url=store.url_of(info.name),
                                             hint="Run `datacache verify` on the source")
                    with fmt.open(path) as r:
                        yield from r
                finally:
                    os.unlink(path)


def cmd_write(ctx: Ctx) -> int:
    a = ctx.args
    kind = _src_type(a.src, a.src_type)
    if kind == "folder":
        samples = _folder_samples(a.src, a.group)
    elif kind == "jsonl":
        samples = _jsonl_samples(a.src)
    elif kind == "parquet":
        samples = _parquet_samples(a.src)
    else:
        samples = _dataset_samples(a.src, ctx.storage_options)
    t0 = time.monotonic()
    with closing(open_store(a.dest, ctx.storage_options)) as dest:
        if not a.force and dest.exists(MANIFEST_NAME):
            raise UsageError(f"{dest.url_of(MANIFEST_NAME)} already exists; pass --force to overwrite the dataset")
        n = 0
        with DatasetWriter(dest.url, format=a.format, shard_bytes=a.shard_bytes, progress=not ctx.quiet,
                           store=dest) as w:
            for sample in samples:
                if a.format == "tar" and "__key__" in sample:  # tar members cannot name a "__" field
                    sample = dict(sample)
                    sample["key"] = sample.pop("__key__")
                try:
                    w.write(sample)
                except (ValueError, TypeError) as exc:
                    key = sample.get("__key__", sample.get("key"))
                    where = f"sample {n}" + (f" ({key})" if isinstance(key, str) else "")
                    raise DatacacheError(f"{where}: {exc}", url=a.src) from exc
                n += 1
            if n == 0:
                raise DatacacheError("no samples found", url=a.src)
        m = w.manifest
        assert m is not None
        url = dest.url
    seconds = time.monotonic() - t0
    ctx.emit({"src": a.src, "src_type": kind, "url": url, "dataset_id": m.dataset_id, "format": m.format,
              "schema": m.schema, "num_shards": len(m.shards), "num_samples": m.num_samples,
              "total_bytes": m.total_bytes, "seconds": round(seconds, 3)},
             [f"wrote {m.num_samples:,} samples from {a.src} ({kind}) to {url}: {len(m.shards)} {m.format} shards, "
              f"{format_size(m.total_bytes)} in {seconds:.1f} s",
              f"  dataset id  {m.dataset_id}", f"  schema      {json.dumps(m.schema)}"])
    return 0


# ------------------------------------------------------------------------------------- verify
def _hash_fd(fd: int, progress: _Progress | None) -> tuple[int, str]:
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
        files = [(key, e, tier, cache.tiers[tier].file_path(rec["file"]))
                 for key, e in cache.entries() if key.startswith(prefix) for tier, rec in e.tiers.items()]
        progress = _Progress(ctx, sum(e.size for _, e, _, _ in files), "verifying cache", len(files), "files")
        try:
            for key, e, tier, path in files:
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
    progress = _Progress(ctx, manifest.total_bytes, "verifying remote", len(manifest.shards), "objects")
    on_bytes = _watch(stop, progress)

    def one(info: ShardInfo, tmpdir: str) -> None:
        if stop.is_set():
            return
        problem = None
        try:
            path, digest = _download(store, info.name, info.bytes, tmpdir, on_bytes)
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
    with NodeCache(ctx.cache_config()) as cache:
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


COMMANDS: dict[str, Callable[[Ctx], int]] = {
    "warm": cmd_warm, "stat": cmd_stat, "ls": cmd_ls, "index": cmd_index, "write": cmd_write,
    "verify": cmd_verify, "clear": cmd_clear,
}
