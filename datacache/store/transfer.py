"""How the store moves bytes, with no fsspec import: the options a filesystem is opened with, what a
forked child keeps of its parent's filesystems, the parallel ranged read of one object (``read_parts``),
ranged GETs that can be abandoned while in flight, and the priority slots that give the link to the
shard needed next. Thread-safe: module state is only appended to, under the GIL.

Ranged GETs that can be abandoned while in flight (used by :mod:`datacache.store.storage`).

On an async fsspec filesystem (s3fs, gcsfs...) the GET runs as a task on fsspec's event loop and
the calling thread waits for it in ``_POLL`` steps, looking at ``cancelled()`` between them: once
it is true the task is cancelled (its connection is dropped) and ``ReadCancelledError`` is raised.
Other filesystems are called directly (local reads are short). Thread-safe; no fsspec import.

Priority slots: at most ``n`` holders at a time, waiters admitted lowest priority value first.

The store uses one per process to cap ranged GETs in flight; the prefetcher passes each shard's
position in the read plan as its priority, so the shard needed next gets the link first instead of
sharing it with shards needed later (ties: first come, first served). Thread-safe; waiting blocks
on a condition variable (no polling).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any

from ..config import TransferConfig
from ..errors import ReadCancelledError

__all__ = ["PrioritySlots", "S3", "abandon_inherited", "cat_range", "endpoint_of", "fs_options", "read_parts",
           "shared_loader"]

S3 = {"s3", "s3a"}
_NO_LISTING_CACHE = S3 | {"gs", "gcs", "abfs", "az", "http", "https"}
_inherited: list[Any] = []  # the parent's filesystem objects, kept alive (never closed) in a child
_loader: list[Any] = []  # shared_loader's, once made (a child inherits it)


def abandon_inherited(fs: Any) -> None:
    """Keep a filesystem inherited across fork alive and unfinalized in the child: closing it here
    (s3fs's finalizer closes aiohttp transports) would unregister the parent's sockets from the
    epoll instance parent and child share, and the parent's next reads would hang."""
    _inherited.append(fs)
    for fin in list(getattr(weakref.finalize, "_registry", {})):
        info = fin.peek()
        if info is not None and info[0] is fs:
            fin.detach()


def shared_loader() -> Any:
    """This process's one botocore data loader (pure data, its parsed service models cached;
    safe to share across threads and after fork), created on first use. No lock (a child could
    inherit it held): two threads racing here each make one, and both use the first kept."""
    if not _loader:
        import botocore.loaders

        _loader.append(botocore.loaders.create_loader())
    return _loader[0]


def _env_endpoint() -> tuple[str | None, str]:
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(var):
            return os.environ[var], var
    return None, ""


def endpoint_of(protocol: str, storage_options: dict | None) -> str:
    """The endpoint a store of ``protocol`` talks to and where that came from, for messages:
    ``"http://host:9000 (from AWS_ENDPOINT_URL)"``, ``"... (from storage_options)"``, or the default."""
    if protocol in ("http", "https"):
        return "the URL's host"
    if protocol not in S3:
        return f"the {protocol!r} filesystem's endpoint"
    opts = storage_options or {}
    given = opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
    if given:
        return f"{given} (from storage_options)"
    env, var = _env_endpoint()
    return f"{env} (from {var})" if env else "the default AWS S3 endpoint"


def fs_options(protocol: str, storage_options: dict | None, transfer: TransferConfig,
                pool_size: int) -> dict[str, Any]:
    opts = dict(storage_options or {})
    opts.setdefault("skip_instance_cache", True)
    if protocol in _NO_LISTING_CACHE:
        opts.setdefault("use_listings_cache", False)
    if protocol == "file":
        opts.setdefault("auto_mkdir", True)
    if protocol in S3:
        client_kwargs = dict(opts.get("client_kwargs") or {})
        env = _env_endpoint()[0]
        if env and "endpoint_url" not in client_kwargs and not opts.get("endpoint_url"):
            client_kwargs["endpoint_url"] = env
        opts["client_kwargs"] = client_kwargs
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("retries", {"mode": "standard", "total_max_attempts": 1})
        config.setdefault("connect_timeout", min(transfer.timeout, 10.0))
        config.setdefault("read_timeout", transfer.timeout)
        config.setdefault("max_pool_connections", max(10, pool_size))
        opts["config_kwargs"] = config
    return opts


def read_parts(size: int, part_bytes: int, concurrency: int, pool: ThreadPoolExecutor | None,
               read_part: Callable[[int, int, Callable[[], bool]], bytes], sink: Callable[[int, bytes], None],
               cancelled: Callable[[], bool] | None = None) -> None:
    """Read ``[0, size)`` as parts of ``part_bytes``: ``sink(start, read_part(start, end, stop))``
    for each, at most ``concurrency`` at a time on ``pool`` (in this thread when ``pool`` is None or
    there is one part). The first failure sets ``stop`` for the parts in flight (they abandon their
    transfer), cancels those not started, waits for the rest and is re-raised; ``cancelled()``
    stops them likewise."""
    parts = [(off, min(off + part_bytes, size)) for off in range(0, size, part_bytes)]
    failed = threading.Event()
    stop = failed.is_set if cancelled is None else (lambda: failed.is_set() or cancelled())

    def one(start: int, end: int) -> None:
        if not failed.is_set():
            sink(start, read_part(start, end, stop))

    if len(parts) == 1 or pool is None:
        for start, end in parts:
            one(start, end)
        return
    pending: set[Future[None]] = set()
    try:
        for start, end in parts:
            pending.add(pool.submit(one, start, end))
            if len(pending) >= concurrency:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    f.result()
        for f in pending:
            f.result()
    except BaseException:
        failed.set()
        for f in pending:
            f.cancel()
        wait(pending)
        raise


_POLL = 0.05  # seconds between looks at the cancel flag while a GET is in flight


def cat_range(fs: Any, path: str, start: int, end: int, cancelled: Callable[[], bool] | None, url: str) -> bytes:
    """``fs.cat_file(path, start=start, end=end)``, abandoned at once when ``cancelled()`` is true."""
    if cancelled is not None and cancelled():
        raise ReadCancelledError("read: cancelled by its caller", url=url)
    if cancelled is None or not getattr(fs, "async_impl", False) or getattr(fs, "asynchronous", False):
        return fs.cat_file(path, start=start, end=end)
    future = asyncio.run_coroutine_threadsafe(fs._cat_file(path, start=start, end=end), fs.loop)
    while True:
        try:
            return future.result(timeout=_POLL)
        except FutureTimeout:
            if future.done():  # the GET's own timeout: aiohttp's are TimeoutErrors too, as is this wait's
                return future.result()
            if cancelled():
                future.cancel()  # cancels the GET's task on the loop
                raise ReadCancelledError("read: cancelled by its caller", url=url) from None


class PrioritySlots:
    """A counting semaphore whose waiters are served in priority order (lowest first, then in
    order of arrival). Each waiter waits on a condition of its own over the one lock, and a slot
    freed wakes only the waiter first in line: with many threads queued (a part mix's fetch
    threads), one wake-up per slot, not one per waiter that then finds it is not its turn.
    Thread-safe."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError("need at least one slot")
        self.n = n
        self._used = 0
        self._lock = threading.Lock()
        self._waiting: list[tuple[float, int, threading.Condition]] = []
        self._tickets = itertools.count()

    @contextmanager
    def hold(self, priority: float = 0.0) -> Iterator[None]:
        with self._lock:
            if self._waiting or self._used >= self.n:
                me = (priority, next(self._tickets), threading.Condition(self._lock))
                heapq.heappush(self._waiting, me)
                try:
                    while self._used >= self.n or self._waiting[0] is not me:
                        me[2].wait()
                except BaseException:  # interrupted (Ctrl-C): out of the line, the next one may go
                    self._waiting.remove(me)
                    heapq.heapify(self._waiting)
                    self._wake()
                    raise
                heapq.heappop(self._waiting)
            self._used += 1
            self._wake()  # the next in line may take a free slot too
        try:
            yield
        finally:
            with self._lock:
                self._used -= 1
                self._wake()

    def _wake(self) -> None:
        """Wake the waiter first in line where a slot is free (the lock held)."""
        if self._waiting and self._used < self.n:
            self._waiting[0][2].notify()
