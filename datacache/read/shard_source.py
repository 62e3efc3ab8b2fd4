"""The one shard path: a dataset's shards fetched through the node cache and read locally.

Every entry point (``StreamingDataset``, ``CachedDataset``, ``datacache warm``) opens its dataset
with ``ShardSource.open`` and goes through it:

- ``fetch(shard, priority=, use_at=)``: the shard into the node cache (one download per node,
  ranged GETs admitted in ``priority`` order, admitted by its next use after ``use_at``), pinned;
- ``read_runs`` / ``read_rows``: samples of a fetched shard, through this process's pool of open
  readers (``datacache.read.open_readers``), with the shard's sample count checked against the manifest;
- every failure is one ``datacache`` error naming the shard's URL: a reader failure is a
  ``datacache.ReaderError``, a count or content mismatch an ``IntegrityError``.

The store's congestion state (``datacache.store.congestion``) is shared by every process of the node
through the cache's control directory, so all of them back off together from a throttling store.

``tell_plan`` is the one place where a dataset tells the cache its future reads. The node-level
schedule helpers (which shards each consumer of the node reads, and when) live in ``nodeplan``.

Thread-safe: any thread may fetch and read; a handle is used by one thread at a time.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..cache.eviction import Schedule
from ..cache.node import CacheHandle, NodeCache
from ..cache.node_policy import NodePolicy
from ..cache.partial import PartialGone, PartialShard
from ..config import CacheConfig, RetryConfig, TransferConfig
from ..errors import IntegrityError, NotFoundError, ReaderError
from ..manifest import Manifest, load_manifest
from ..peer.tier import PeerTier
from ..readers import ReaderError as ShardReaderError
from ..readers import RefusedContentError, get_format
from ..store.storage import Store, open_store
from .open_readers import open_shards

__all__ = ["ShardSource", "PartHandle", "tell_plan", "make_cache"]

log = logging.getLogger("datacache.read.shard_source")


def make_cache(cache: CacheConfig | NodeCache | None) -> NodeCache:
    """The node cache to use: a given ``NodeCache`` as is, else one opened from the config (or the
    default ``CacheConfig()``)."""
    return cache if isinstance(cache, NodeCache) else NodeCache(cache or CacheConfig())


def tell_plan(cache: NodeCache, schedule: Schedule | None,
              owned: Mapping[str, frozenset[str]] | None = None) -> Schedule | None:
    """Tell ``cache`` the node's future reads of ``schedule``'s dataset: with a clairvoyant cache
    (``policy`` other than "lru") it evicts and admits by the next uses of every dataset in use on
    the node (``NodePolicy``: the schedules told in this process, one per dataset, and those other
    processes published next to the cache). ``owned``: with the peer tier, the keys of each dataset
    this node keeps for the job (``NodePolicy.tell_owned``: its other cached keys, copies a peer
    also holds, go first). Returns the schedule in force (None for an LRU cache, or when there is
    no schedule), which the reader then ``advance``s."""
    if cache.config.policy == "lru" or (schedule is None and not owned):
        return None
    policy = cache.policy
    if not isinstance(policy, NodePolicy):
        policy = NodePolicy.for_cache(cache)
        cache.set_policy(policy)
    for dataset, keys in (owned or {}).items():
        policy.tell_owned(dataset, keys)
    if schedule is None:
        return None
    policy.tell(schedule)
    return schedule


class ShardSource:
    """One dataset's shards through one node cache (see the module docstring).

    ``store``: where the shards live; ``manifest``: the dataset; ``cache``: the node cache;
    ``reader_options``: keyword arguments for the format's ``open``, over those the manifest
    records (``Manifest.reader_options``).
    """

    def __init__(self, store: Store, manifest: Manifest, cache: NodeCache, *,
                 reader_options: Mapping[str, Any] | None = None) -> None:
        self.store, self.manifest, self.cache = store, manifest, cache
        self.reader_options = manifest.reader_options(reader_options)
        self.fmt = get_format(manifest.format)
        self.peers: PeerTier | None = None  # the peer tier (``datacache.read.peers.attach``)
        # Whether this source's shards are read as tables (``read_columns``), in this epoch or a
        # later one: its cached shards' readers, kept open across reads, then make their tables
        # when first handed out again (``OpenShards.checkout``), sample-by-sample reads included.
        self.tables = False
        self._by_name: dict[str, int] | None = None
        self._init_parts()

    def _init_parts(self) -> None:
        self._partials: dict[int, PartialShard] = {}  # this process's handles on partial copies
        self._partials_pid = os.getpid()
        self._partials_lock = threading.Lock()
        self._part_readers = _PartReaders()
        self._whole: set[int] = set()  # shards whose partial copy gave up here (no room, not a valid file)

    def __getstate__(self) -> dict[str, Any]:  # a spawned DataLoader worker opens its own partial copies
        state = self.__dict__.copy()
        for name in ("_partials", "_partials_pid", "_partials_lock", "_part_readers"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_parts()

    @classmethod
    def open(cls, url: str, *, storage_options: Mapping[str, Any] | None = None,
             cache: CacheConfig | NodeCache | None = None, transfer: TransferConfig | None = None,
             retry: RetryConfig | None = None, reader_options: Mapping[str, Any] | None = None) -> "ShardSource":
        """Open the store at ``url`` (with ``storage_options``, ``transfer`` and ``retry``), load its
        manifest, and open ``cache`` (see ``make_cache``). Raises the store's and manifest's errors."""
        store = open_store(url, dict(storage_options or {}), transfer=transfer, retry=retry)
        try:
            manifest = load_manifest(store)
            node_cache = make_cache(cache)
        except BaseException:
            store.close()
            raise
        store.share_congestion(node_cache.control_dir)  # every process of the node backs off together
        return cls(store, manifest, node_cache, reader_options=reader_options)

    def url(self, shard: int) -> str:
        """The URL of shard number ``shard``."""
        return self.store.url_of(self.manifest.shards[shard].name)

    def key(self, shard: int) -> str:
        """The node-cache key of shard number ``shard``."""
        return self.manifest.cache_key(shard)

    # ------------------------------------------------------------------ fetch
    def fetch(self, shard: int, *, priority: float | None = None, use_at: float | None = None,
              into: str | None = None, on_bytes: Callable[[int], None] | None = None,
              on_fetch: Callable[[], None] | None = None, cancelled: Callable[[], bool] | None = None,
              via_peers: bool = True, peers_only: bool = False) -> CacheHandle:
        """Shard number ``shard``, pinned in the node cache, downloaded on a miss.

        ``priority``: lower is sooner, for the store's request slots (the plan position);
        ``use_at``: the schedule time of the read this fetch serves (admission by next use);
        ``into``: fill a miss into this tier only (see ``NodeCache.get``); ``on_bytes(n)``: called
        as bytes arrive; ``on_fetch()``: called when this call downloads (a miss it serves);
        ``cancelled()``: true abandons the download at once (``ReadCancelledError``, nothing cached).
        With the peer tier (``peers``) a miss asks the peers first (``datacache.peer.tier``);
        ``via_peers=False``: the store only; ``peers_only``: a peer that holds it, or
        ``datacache.peer.client.PeerFailed`` (``repair``).
        """
        info = self.manifest.shards[shard]

        def from_store(path: str, stop: Callable[[], bool] | None = cancelled) -> None:
            kw: dict[str, Any] = {"size": info.bytes, "cancelled": stop}
            if priority is not None:
                kw["priority"] = priority
            if on_bytes is not None:
                kw["on_bytes"] = on_bytes
            try:
                self.store.read_into(info.name, path, **kw)
            except NotFoundError as exc:  # not the store's generic hint: the manifest names this shard
                raise self._missing(shard) from exc

        def download(path: str) -> None:
            if on_fetch is not None:
                on_fetch()
            if self.peers is None or not via_peers:
                return from_store(path)
            if self.peers.fetch_into(shard, path, None if peers_only else from_store, cancelled) == "peer" \
                    and on_bytes is not None:
                on_bytes(info.bytes)

        try:
            return self.cache.get(self.key(shard), download, size=info.bytes, hash=info.hash, use_at=use_at,
                                  into=into)
        except IntegrityError as exc:
            if exc.url is not None:
                raise
            raise self._with_url(shard, exc) from exc

    # ------------------------------------------------------------------ serving peers (datacache.peer.server)
    def _shard_named(self, name: str, digest: str) -> int | None:
        if self._by_name is None:
            self._by_name = {s.name: i for i, s in enumerate(self.manifest.shards)}
        i = self._by_name.get(name)
        return i if i is not None and self.manifest.shards[i].hash == digest else None

    def size_of(self, name: str, digest: str) -> int | None:
        """The bytes of shard ``name`` if it has hash ``digest``, else None."""
        i = self._shard_named(name, digest)
        return None if i is None else self.manifest.shards[i].bytes

    def fetch_for_peer(self, name: str, digest: str) -> CacheHandle:
        """Shard ``name`` (hash ``digest``), pinned: what this node's server downloads for the job as
        the shard's owner, from the node cache, a peer that holds a copy (never another owner: this
        node is the owner), or the store."""
        i = self._shard_named(name, digest)
        if i is None:
            raise KeyError(name)
        return self.fetch(i, via_peers=self.peers is not None and int(self.peers.owner[i]) == self.peers.membership.me)

    def repair(self, limit: int = 16) -> int:
        """Fetch up to ``limit`` shards this node owns but does not hold from peers that hold them
        (stand-ins, ``datacache.peer.tier``; never from the store), into free room only; how many
        came. What the node's server does every few seconds, so the job's copies end up with their
        owners."""
        tier = self.peers
        if tier is None or tier.membership.me < 0:
            return 0
        missing = [i for i in tier.owned().tolist() if self.cache.contains(self.key(i)) is None]
        room, done = sum(self.cache.room().values()), 0
        for i in tier.held_elsewhere(missing):
            size = self.manifest.shards[i].bytes
            if done >= limit or size > room:
                break
            try:
                self.fetch(i, peers_only=True).release()
            except Exception as exc:  # noqa: BLE001 - a repair is best effort: the holder is gone, say
                log.debug("datacache: repair of %s failed: %s", self.url(i), exc)
                continue
            room, done = room - size, done + 1
        return done

    def _missing(self, shard: int) -> NotFoundError:
        """The error for a shard the manifest names and the store lacks."""
        return NotFoundError(
            f"the manifest names shard {self.manifest.shards[shard].name!r} but the store has no such object",
            url=self.url(shard),
            hint="The dataset was replaced or its shards deleted after this manifest was read: open "
                 "the dataset again to read its current manifest, or rewrite it")

    def _with_url(self, shard: int, exc: IntegrityError) -> IntegrityError:
        """``exc`` (from the cache, which knows keys, not URLs) naming shard ``shard``'s URL."""
        if exc.url is not None:
            return exc
        err = IntegrityError(str(exc), url=self.url(shard))
        err.hint = exc.hint  # already in the message
        return err

    def load_rows(self, shard: int, rows: Iterable[int], *, priority: float | None = None,
                  use_at: float | None = None,
                  cancelled: Callable[[], bool] | None = None) -> "CacheHandle | PartHandle":
        """The samples at the shard-local ``rows`` of shard ``shard`` made local, for ``read_rows``:
        a pinned cache handle where the shard is cached (or is once they are in), else a
        ``PartHandle`` on the node's partial copy of the shard with the units holding them in
        (``datacache.cache.partial``: ranged reads, each unit fetched once per node). A format without
        a ``layout``, or no room for a copy: the whole shard, as ``fetch``. ``priority``,
        ``use_at``, ``cancelled``: as for ``fetch``."""
        partial = self._partial(shard)
        if partial is not None:
            name = self.manifest.shards[shard].name

            def fetch(start: int, end: int) -> bytes:
                try:
                    return self.store.read_range(name, start, end, priority=priority or 0.0, cancelled=cancelled)
                except NotFoundError as exc:
                    raise self._missing(shard) from exc
            try:
                if not partial.ensure(sorted(set(int(r) for r in rows)), fetch, use_at=use_at):
                    return PartHandle(partial.path or "")
            except PartialGone as exc:
                if not self.cache.contains(self.key(shard)):  # not completed elsewhere: whole from now on
                    log.info("datacache: reading %s whole: %s", self.url(shard), exc)
                    with self._partials_lock:
                        self._whole.add(shard)
            except IntegrityError as exc:
                self._forget(shard)
                raise self._with_url(shard, exc) from exc
            self._forget(shard)
        return self.fetch(shard, priority=priority, use_at=use_at, cancelled=cancelled)

    @property
    def partial_reads(self) -> bool:
        """Whether this dataset's shards can be read part by part (``load_rows``): the format has a
        layout and the files are not compressed whole (reader option ``compression``: an MDS or LitData
        shard whose bytes are not its samples' bytes)."""
        return self.fmt.layout is not None and not self.reader_options.get("compression")

    def _partial(self, shard: int) -> PartialShard | None:
        """This process's handle on shard ``shard``'s partial copy (None: cached, no partial reads, or the
        peer tier is on: whole shards through it, so each crosses the store link once for the job)."""
        if not self.partial_reads or shard in self._whole or self.peers is not None or \
                self.cache.contains(self.key(shard)) is not None:
            return None
        with self._partials_lock:
            if self._partials_pid != os.getpid():  # a forked child: the parent's handles are not ours
                self._partials, self._partials_pid = {}, os.getpid()
            partial = self._partials.get(shard)
            if partial is None:
                info = self.manifest.shards[shard]
                partial = self._partials[shard] = PartialShard(
                    self.cache, self.key(shard), size=info.bytes, digest=info.hash, samples=info.samples,
                    layout_of=self.fmt.layout, name=self.url(shard))
            return partial

    def _forget(self, shard: int) -> None:
        """Drop this process's handle and reader of shard ``shard``'s partial copy (another thread
        may still use the handle: it closes when the last one lets go of it)."""
        with self._partials_lock:
            if self._partials_pid == os.getpid():
                self._partials.pop(shard, None)
        self._part_readers.drop(shard)

    def forget_parts(self) -> None:
        """Drop this process's handles and readers of partial copies (the copies stay: they are the
        node's; a later ``load_rows`` reopens them). A consumer does so when its epoch ends."""
        with self._partials_lock:  # handles close when no thread uses them any more (PartialShard.__del__)
            self._partials, self._whole = {}, set()
        self._part_readers.close()

    # ------------------------------------------------------------------ read
    def inflation(self, shards: Iterable[int]) -> float | None:
        """Bytes of memory that reading ``shards`` decompresses per byte of them (the rest is read in
        place from the cached files): the largest over those of them the node's cache holds now
        (no fetch, no hit counted); None where it holds none of them, or the format does not say
        (``inflation`` of its reader)."""
        got = []
        for shard in shards:
            handle = self.cache.peek(self.key(shard))
            if handle is None:
                continue
            try:
                value = self._read_with(shard, handle.path, lambda r: getattr(r, "inflation", None), pooled=True,
                                        fd=handle.fd)
            except (ReaderError, IntegrityError):
                return None  # read again, where the error is reported as a read's
            finally:
                handle.release()
            if value is None:
                return None
            got.append(float(value))
        return max(got) if got else None

    def read_runs(self, shard: int, handle: CacheHandle, lo: int, hi: int) -> list[Any]:
        """Samples ``lo`` to ``hi - 1`` of the fetched shard (``handle``), read sequentially."""
        return self._with_reader(shard, handle, lambda r: list(r.iter_range(lo, hi)))

    def read_rows(self, shard: int, handle: "CacheHandle | PartHandle", rows: Iterable[int], *,
                  copy: bool = False) -> dict[int, Any]:
        """The samples at the shard-local indices ``rows`` of the fetched shard: one sequential
        read of their span when they are dense in it, else one random read each (always so in a
        partial copy, ``load_rows``: only the units holding ``rows`` are in). ``copy``: samples
        in memory of their own (``ShardReader.get_many``), to keep past the shard's release."""
        rows = sorted(set(int(r) for r in rows))
        if not rows:
            return {}
        lo, hi = rows[0], rows[-1] + 1

        def read(r: Any) -> dict[int, Any]:
            if hi - lo <= 4 * len(rows) and not copy and not isinstance(handle, PartHandle):
                span = list(r.iter_range(lo, hi))
                return {i: span[i - lo] for i in rows}
            return dict(zip(rows, r.get_many(rows, copy=copy)))
        return self._with_reader(shard, handle, read)

    def read_columns(self, shard: int, handle: CacheHandle, lo: int, hi: int, rows: Any = None,
                     blocks: Any = None) -> Any:
        """Samples ``lo`` to ``hi - 1`` of the fetched shard (or only ``rows``, sorted, within
        them) as one ``readers.columns.Columns`` table, or None where the format has no columnar
        reads or the rows are too irregular for one table (``ZstdShardReader.columns``;
        ``blocks``: its ``BlockCache``)."""
        def read(r: Any) -> Any:
            columns = getattr(r, "columns", None)
            return None if columns is None else columns(lo, hi, rows, blocks)
        return self._with_reader(shard, handle, read)

    def _with_reader(self, shard: int, handle: "CacheHandle | PartHandle", work: Callable[[Any], Any]) -> Any:
        if isinstance(handle, PartHandle):
            try:
                return self._part_readers.read(shard, handle.path, work, self._read_with)
            except FileNotFoundError:  # completed into the cache by another process meanwhile
                cached = self.fetch(shard)
                try:
                    return self._read_with(shard, cached.path, work, pooled=True, fd=cached.fd)
                finally:
                    cached.release()
        return self._read_with(shard, handle.path, work, pooled=True, fd=handle.fd)

    def _read_with(self, shard: int, path: str, work: Callable[[Any], Any], *, pooled: bool,
                   fd: int | None = None) -> Any:
        """``work(reader)`` over the file ``path`` (a reader from the process's pool: a cache entry,
        whose bytes never change; ``fd``: the pin's descriptor of it, see ``OpenShards.checkout``),
        or ``work`` of a fresh reader, open, returned with the result (``pooled=False``: a partial
        copy's, kept by ``_PartReaders``)."""
        pool = open_shards()
        try:
            if pooled:
                reader = pool.checkout(self.fmt, path, self.reader_options, tables=self.tables, fd=fd)
            else:
                reader = self.fmt.open(path, **self.reader_options)
            try:
                self._check_count(shard, reader)
                out = work(reader)
            except BaseException:  # a reader neither returned nor kept is closed, not left mapped
                reader.close()
                raise
            if not pooled:
                return out, reader
            pool.checkin(self.fmt, path, reader, self.reader_options, tables=self.tables)
            return out
        except (ShardReaderError, ValueError, OSError) as exc:
            if isinstance(exc, (ReaderError, IntegrityError)) or (not pooled and isinstance(exc, FileNotFoundError)):
                raise  # a partial copy's FileNotFoundError: the caller reads the cache entry
            if isinstance(exc, RefusedContentError):  # it says what to do: no guess about the format
                raise ReaderError(exc.message, url=self.url(shard)) from exc
            raise ReaderError(f"cannot read shard as {self.manifest.format!r}: {exc}", url=self.url(shard),
                              hint="Check the manifest's format, or rebuild the shard") from exc

    def _check_count(self, shard: int, reader: Any) -> None:
        declared, actual = self.manifest.shards[shard].samples, len(reader)
        if declared != actual:
            raise IntegrityError(f"the shard holds {actual} samples, the manifest declares {declared}",
                                 url=self.url(shard),
                                 hint="The manifest does not belong to these shards: rewrite the dataset, or "
                                      "rebuild its manifest with `datacache index`")

    def close(self) -> None:
        """Close the store's connections and this process's handles on partial copies (the cache
        and the copies stay: they are the node's). Idempotent."""
        self.forget_parts()
        self.store.close()


class PartHandle:
    """Samples of a shard not (yet) cached, readable in the node's partial copy at ``path``
    (``ShardSource.load_part``). ``release`` does nothing: the copy is the node's, not pinned."""

    def __init__(self, path: str) -> None:
        self.path = path

    def release(self) -> None:
        """Nothing to release (see the class docstring); for symmetry with ``CacheHandle``."""


class _PartReaders:
    """This process's open readers of partial copies, one per shard, kept while the copy is read
    (opening one maps and indexes the file: milliseconds). A reader of a partial copy stays right
    as units arrive: its copy-on-write map shows the file's current bytes wherever no sample it
    handed out was written to (``readers._cowmap``). Thread-safe: one lock per reader, held while
    it reads (mapped memory, no I/O); reopened when the path holds another file."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, tuple[int, Any, threading.Lock]] = {}  # shard -> (inode, reader, its lock)
        self._pid = os.getpid()

    def read(self, shard: int, path: str, work: Callable[[Any], Any],
             open_read: Callable[..., Any]) -> Any:
        """``work(reader)`` with shard ``shard``'s reader of ``path`` (``open_read`` opens one:
        ``ShardSource._read_with``). ``FileNotFoundError``: ``path`` is gone."""
        ino = os.stat(path).st_ino
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's readers are not ours
                self._open, self._pid = {}, os.getpid()
            held = self._open.get(shard)
        if held is not None and held[0] == ino:
            with held[2]:
                if not held[1].closed:  # dropped meanwhile (its copy completed): open another
                    return work(held[1])
        out, reader = open_read(shard, path, work, pooled=False)
        with self._lock:
            old = self._open.get(shard)
            self._open[shard] = (ino, reader, threading.Lock())
        if old is not None:
            with old[2]:
                old[1].close()
        return out

    def drop(self, shard: int) -> None:
        """Close shard ``shard``'s reader, if open."""
        with self._lock:
            held = self._open.pop(shard, None) if self._pid == os.getpid() else None
        if held is not None:
            with held[2]:
                held[1].close()

    def close(self) -> None:
        """Close every reader. Idempotent."""
        with self._lock:
            held, self._open = (list(self._open.values()) if self._pid == os.getpid() else []), {}
        for _, reader, lock in held:
            with lock:
                reader.close()
