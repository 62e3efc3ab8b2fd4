"""The one shard path: a dataset's shards fetched through the node cache and read locally.

Every entry point (``StreamingDataset``, ``CachedDataset``, ``datacache warm``) opens its dataset
with ``ShardSource.open`` and goes through it:

- ``fetch(shard, priority=, use_at=)``: the shard into the node cache (one download per node,
  ranged GETs admitted in ``priority`` order, admitted by its next use after ``use_at``), pinned;
- ``read_runs`` / ``read_rows``: samples of a fetched shard, through this process's pool of open
  readers (``_openshards``), with the shard's sample count checked against the manifest;
- every failure is one ``datacache`` error naming the shard's URL: a reader failure is a
  ``datacache.ReaderError``, a count or content mismatch an ``IntegrityError``.

The store's congestion state (``datacache.congestion``) is shared by every process of the node
through the cache's control directory, so all of them back off together from a throttling store.

``tell_plan`` is the one place where a dataset tells the cache its future reads. The node-level
schedule helpers (which shards each consumer of the node reads, and when) live in ``nodeplan``.

Thread-safe: any thread may fetch and read; a handle is used by one thread at a time.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import readers

from ._openshards import open_shards
from .cache import CacheHandle, NodeCache
from .config import CacheConfig, RetryConfig, TransferConfig
from .errors import IntegrityError, NotFoundError, ReaderError
from .eviction import Schedule
from .manifest import Manifest, load_manifest
from .nodepolicy import NodePolicy
from .storage import Store, open_store

__all__ = ["ShardSource", "tell_plan", "make_cache"]


def make_cache(cache: CacheConfig | NodeCache | None) -> NodeCache:
    """The node cache to use: a given ``NodeCache`` as is, else one opened from the config (or the
    default ``CacheConfig()``)."""
    return cache if isinstance(cache, NodeCache) else NodeCache(cache or CacheConfig())


def tell_plan(cache: NodeCache, schedule: Schedule | None) -> Schedule | None:
    """Tell ``cache`` the node's future reads of ``schedule``'s dataset: with a clairvoyant cache
    (``policy`` other than "lru") it evicts and admits by the next uses of every dataset in use on
    the node (``NodePolicy``: the schedules told in this process, one per dataset, and those other
    processes published next to the cache). Returns the schedule in force (None for
    an LRU cache, or when there is no schedule), which the reader then ``advance``s."""
    if schedule is None or cache.config.policy == "lru":
        return None
    policy = cache.policy
    if not isinstance(policy, NodePolicy):
        policy = NodePolicy.for_cache(cache)
        cache.set_policy(policy)
    policy.tell(schedule)
    return schedule


class ShardSource:
    """One dataset's shards through one node cache (see the module docstring).

    ``store``: where the shards live; ``manifest``: the dataset; ``cache``: the node cache;
    ``reader_options``: keyword arguments for the format's ``open``.
    """

    def __init__(self, store: Store, manifest: Manifest, cache: NodeCache, *,
                 reader_options: Mapping[str, Any] | None = None) -> None:
        self.store, self.manifest, self.cache = store, manifest, cache
        self.reader_options = dict(reader_options or {})
        self.fmt = readers.get_format(manifest.format)

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
              on_fetch: Callable[[], None] | None = None, cancelled: Callable[[], bool] | None = None) -> CacheHandle:
        """Shard number ``shard``, pinned in the node cache, downloaded on a miss.

        ``priority``: lower is sooner, for the store's request slots (the plan position);
        ``use_at``: the schedule time of the read this fetch serves (admission by next use);
        ``into``: fill a miss into this tier only (see ``NodeCache.get``); ``on_bytes(n)``: called
        as bytes arrive; ``on_fetch()``: called when this call downloads (a miss it serves);
        ``cancelled()``: true abandons the download at once (``ReadCancelledError``, nothing cached).
        """
        info = self.manifest.shards[shard]

        def download(path: str) -> None:
            if on_fetch is not None:
                on_fetch()
            kw: dict[str, Any] = {"size": info.bytes, "cancelled": cancelled}
            if priority is not None:
                kw["priority"] = priority
            if on_bytes is not None:
                kw["on_bytes"] = on_bytes
            try:
                self.store.read_into(info.name, path, **kw)
            except NotFoundError as exc:  # not the store's generic hint: the manifest names this shard
                raise NotFoundError(
                    f"the manifest names shard {info.name!r} but the store has no such object", url=self.url(shard),
                    hint="The dataset was replaced or its shards deleted after this manifest was read: open "
                         "the dataset again to read its current manifest, or rewrite it") from exc

        try:
            return self.cache.get(self.key(shard), download, size=info.bytes, hash=info.hash, use_at=use_at,
                                  into=into)
        except IntegrityError as exc:
            if exc.url is not None:
                raise
            err = IntegrityError(str(exc), url=self.url(shard))  # the cache knows keys, not URLs
            err.hint = exc.hint  # already in the message
            raise err from exc

    # ------------------------------------------------------------------ read
    def read_runs(self, shard: int, handle: CacheHandle, lo: int, hi: int) -> list[Any]:
        """Samples ``lo`` to ``hi - 1`` of the fetched shard (``handle``), read sequentially."""
        return self._with_reader(shard, handle, lambda r: list(r.iter_range(lo, hi)))

    def read_rows(self, shard: int, handle: CacheHandle, rows: Iterable[int]) -> dict[int, Any]:
        """The samples at the shard-local indices ``rows`` of the fetched shard: one sequential
        read of their span when they are dense in it, else one random read each."""
        rows = sorted(set(int(r) for r in rows))
        if not rows:
            return {}
        lo, hi = rows[0], rows[-1] + 1

        def read(r: Any) -> dict[int, Any]:
            if hi - lo <= 4 * len(rows):
                span = list(r.iter_range(lo, hi))
                return {i: span[i - lo] for i in rows}
            return dict(zip(rows, r.get_many(rows)))
        return self._with_reader(shard, handle, read)

    def _with_reader(self, shard: int, handle: CacheHandle, work: Callable[[Any], Any]) -> Any:
        pool = open_shards()
        try:
            reader = pool.checkout(self.fmt, handle.path, self.reader_options)
            try:
                self._check_count(shard, reader)
                out = work(reader)
            except BaseException:
                reader.close()
                raise
            pool.checkin(self.fmt, handle.path, reader, self.reader_options)
            return out
        except (readers.ReaderError, ValueError, OSError) as exc:
            if isinstance(exc, (ReaderError, IntegrityError)):
                raise
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
        """Close the store's connections (the cache stays open: it may be shared). Idempotent."""
        self.store.close()
