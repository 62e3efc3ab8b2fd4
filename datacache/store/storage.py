"""Object storage access: the only datacache module that imports fsspec (and, through it, s3fs).

``open_store(url)`` returns a :class:`Store` rooted at a dataset prefix on any fsspec URL
(``s3://bucket/prefix/``, ``file:///abs/dir``, a plain local path, ``memory://x/``, ``gs://``...).
Whole objects are read as parallel byte-range GETs of ``TransferConfig.part_bytes`` with
``TransferConfig.concurrency`` parts in flight per object and at most ``max_requests`` ranged GETs
in flight per process (a FIFO semaphore: the parts asked for first are served first, so the shard
needed next gets the link instead of sharing it with shards needed later; see ``datacache.store.transfer``), on the
store's thread pool (threads named
``datacache-io-N``, 4 x concurrency of them, at most 64, shared by concurrent calls); ``read_into``
writes each part at its offset with ``os.pwrite`` so a shard never has to be held in memory.

Cancellation: ``read_into(..., cancelled=f)`` abandons the read as soon as ``f()`` is true (Ctrl-C in
the CLI, a closed prefetcher, a DataLoader worker whose parent died): on async filesystems (s3fs) a
ranged GET in flight is cancelled on fsspec's event loop (its connection is dropped) within
50 ms (``datacache.store.transfer``), parts not started are not started, and ``ReadCancelledError`` is raised.
A part that fails also cancels its siblings that way.

Congestion: every request also takes a place in the prefix's congestion window
(:mod:`datacache.store.congestion`; AIMD, a backoff gate after throttling answers, an optional
``max_requests_per_s`` budget), private to the process unless ``share_congestion(control_dir)``
makes it node-wide (``ShardSource.open`` does, with the node cache's control directory).

Reliability: every backend call goes through one bounded retry policy (:mod:`datacache.store.retry`,
``RetryConfig``: until a deadline, exponential backoff with full jitter; throttling answers are
spaced by the node's congestion gate instead). s3fs's and botocore's
own retries are switched off (``S3FileSystem.retries = 1`` and botocore ``total_max_attempts=1``; s3fs still
sleeps ~0.1 s once after a throttling error) so that policy is the only one that counts and its
bounds are real. A store that has never answered this ``Store`` (or the one it was pickled or
forked from) and refuses the connection or whose name does not resolve is a wrong endpoint or a
store that is not running: it is retried only ``RetryConfig.connect_deadline`` seconds, then
``UnreachableError`` names ``Store.endpoint`` and the cause; once it has answered, outages get the
whole deadline. Backend errors are translated where they enter (``raise X(...) from exc``) into
:mod:`datacache.errors`; messages name the full URL, the cause and what to do, and never contain
credentials (they are scrubbed from every message; ``repr(store)`` shows no options).

Freshness: s3fs instances are never shared (``skip_instance_cache=True``) and listings are not
cached (``use_listings_cache=False``), so ``size``/``exists``/``list`` always ask the store.

Thread-safety and fork-safety: a ``Store`` is thread-safe; any number of threads may call any
method concurrently. It is also fork-safe: after ``os.fork()`` (DataLoader workers) the child lazily
builds its own filesystem instance and thread pool on first use (the pid is tracked, and locks and
request slots are re-created in the child by an ``os.register_at_fork`` hook: the parent's other
threads may hold them at the fork, and none of them runs in the child to give them back). The
parent's filesystem object is left untouched in the child (closing it there would disturb the
parent's connections); ``stats()`` restart from zero in the child.
"""
from __future__ import annotations

import os
import re
import threading
import time
import weakref
from concurrent.futures import CancelledError, ThreadPoolExecutor
from contextlib import nullcontext
from itertools import count
from typing import Any, Callable

import fsspec
from fsspec.core import split_protocol

from .._localfs import replace_local
from ..config import RetryConfig, TransferConfig
from ..errors import IntegrityError, NotFoundError, StorageError
from ..manifest import MANIFEST_NAME
from .congestion import Congestion
from .presigned import PresignedRanges
from .presigned import usable as presigned_usable
from .retry import ShortReadError, answered, error_code, retry_call, secret_values
from .retry import check_name as _check_name
from .transfer import (
    S3,
    PrioritySlots,
    abandon_inherited,
    cat_range,
    endpoint_of,
    fs_options,
    read_parts,
    shared_loader,
)

__all__ = ["open_store", "Store", "check_url"]

SMALL_READ = 64 << 10  # read_range: a read this small takes no request slot
_thread_ids = count()
_stores: "weakref.WeakSet[Store]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_stores):
        store._reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(?!//)(.*)$", re.S)


def check_url(url: str) -> str:
    """``url`` if it is a URL or a local path datacache can open, else ValueError saying why: a
    chained fsspec URL, or a known scheme not followed by ``//`` (``s3:/bucket/x/``, which would
    otherwise be read as the local folder ``./s3:/bucket/x``). Pure."""
    if "::" in url:
        raise ValueError(f"chained fsspec URLs are not supported: {url!r}")
    m = _SCHEME.match(url)
    if m is not None and m.group(1).lower() in fsspec.available_protocols():
        scheme, rest = m.group(1), m.group(2)
        fixed = f"{scheme}://{rest if scheme.lower() in ('file', 'local') else rest.lstrip('/')}"
        raise ValueError(f"{url!r} is not a valid URL: {scheme + ':'!r} must be followed by '//' "
                         f"(did you mean {fixed!r}?)")
    return url


def _normalize(url: str) -> tuple[str, str]:
    """``(protocol, normalized url ending with "/")``; plain paths become ``file://`` URLs. A URL
    naming the dataset's manifest (``.../manifest.json``) opens the prefix that holds it."""
    check_url(url)
    if url.rstrip("/").endswith("/" + MANIFEST_NAME) or url == MANIFEST_NAME:
        url = url.rstrip("/")[: -len(MANIFEST_NAME)] or "."
    protocol, path = split_protocol(url)
    if protocol in (None, "file", "local"):
        local = os.path.abspath(os.path.expanduser(path))
        return "file", "file://" + local.rstrip("/") + "/"
    return protocol, url.rstrip("/") + "/"


def open_store(url: str, storage_options: dict | None = None, *, transfer: TransferConfig | None = None,
               retry: RetryConfig | None = None) -> "Store":
    """Open the dataset prefix ``url``. Nothing is contacted until the first call."""
    return Store(url, storage_options, transfer=transfer, retry=retry)


class Store:
    """A dataset prefix on an object store or file system. Thread-safe and fork-safe (see module).
    ``endpoint``: the endpoint it talks to and where that setting came from (for messages)."""

    def __init__(self, url: str, storage_options: dict | None = None, *,
                 transfer: TransferConfig | None = None, retry: RetryConfig | None = None) -> None:
        self.protocol, self.url = _normalize(url)
        self.transfer = transfer or TransferConfig()
        self.retry = retry or RetryConfig()
        c = self.transfer.concurrency
        self._pool_size = max(c, self.transfer.max_requests, min(64, 4 * c))
        self._options = fs_options(self.protocol, storage_options, self.transfer, self._pool_size)
        self._secret_values = secret_values(storage_options)
        self.endpoint = endpoint_of(self.protocol, storage_options)
        self._answered = False  # the store answered once (here or where this Store was pickled or forked from)
        self.congestion = self._congestion(None)
        self._init_state()
        _stores.add(self)

    def _congestion(self, control_dir: str | None) -> Congestion:
        return Congestion(self.url, control_dir, base_delay=self.retry.base_delay, max_delay=self.retry.max_delay,
                          max_requests_per_s=self.transfer.max_requests_per_s)

    def share_congestion(self, control_dir: str) -> None:
        """Back off together with every process of the node: keep this prefix's congestion state
        (``datacache.store.congestion``) in a node cache's ``control_dir``. Call before the first read."""
        self.congestion = self._congestion(control_dir)

    def _init_state(self) -> None:
        self._lock = threading.Lock()
        self._requests = PrioritySlots(self.transfer.max_requests)
        self._range_requests = PrioritySlots(self.transfer.range_requests)
        self._pid = os.getpid()
        self._fs: Any = None
        self._presigned: PresignedRanges | None = None
        self._root = ""
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._stats: dict[str, Any] = {"requests": 0, "retries": 0, "bytes_read": 0, "bytes_written": 0,
                                       "errors": {}}

    def _reset_after_fork(self) -> None:
        # Runs in the child: the parent's threads do not exist here and its locks may be held, as
        # may its request slots (the parent's downloads in flight, and their waiters' places in
        # line): inherited, they would never be given back here and the child would wait forever.
        self._lock = threading.Lock()
        self._requests = PrioritySlots(self.transfer.max_requests)
        self._range_requests = PrioritySlots(self.transfer.range_requests)
        self._pid = os.getpid()
        if self._fs is not None:
            abandon_inherited(self._fs)
        self._fs, self._pool, self._presigned = None, None, None
        self._stats = {"requests": 0, "retries": 0, "bytes_read": 0, "bytes_written": 0, "errors": {}}

    def _session(self) -> dict[str, Any]:
        """For s3: a new botocore session on the process's one data loader (``datacache.store.transfer.shared_loader``,
        inherited across fork), so that the service models are parsed once per process, not once
        per store: a store's first request took 0.21 s here, 0.09 s with it (a mix opens a store
        per stream, a DataLoader worker its own). Credentials and clients stay each store's own."""
        if self.protocol not in S3 or "session" in self._options:
            return {}
        try:
            from aiobotocore.session import AioSession

            session = AioSession(profile=self._options.get("profile"))
            session.register_component("data_loader", shared_loader())
        except Exception:  # noqa: BLE001 - an optimisation only: s3fs makes its own session
            return {}
        return {"session": session}

    def __getstate__(self) -> dict[str, Any]:
        return {k: self.__dict__[k] for k in ("protocol", "url", "transfer", "retry", "_pool_size", "_options",
                                               "_secret_values", "congestion", "endpoint", "_answered")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_state()
        _stores.add(self)

    def __repr__(self) -> str:
        return f"Store({self.url!r}, part_bytes={self.transfer.part_bytes}, concurrency={self.transfer.concurrency})"

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------
    def _redact(self, text: str) -> str:
        for secret in self._secret_values:
            text = text.replace(secret, "***")
        return text

    def _ensure(self) -> tuple[Any, ThreadPoolExecutor]:
        """The filesystem and pool of this process, created lazily (again after a fork)."""
        if self._pid != os.getpid():
            self._reset_after_fork()
        fs, pool = self._fs, self._pool
        if fs is not None and pool is not None:
            return fs, pool
        with self._lock:
            if self._closed:
                raise StorageError("the store is closed", url=self.url, hint="Open a new one with open_store()")
            if self._fs is None:
                try:
                    fs = fsspec.filesystem(self.protocol, **self._options, **self._session())
                except Exception as exc:
                    raise StorageError(
                        f"cannot create a {self.protocol!r} filesystem "
                        f"({self._redact(f'{type(exc).__name__}: {exc}')})",
                        url=self.url, hint="Check the URL scheme and storage_options; a missing backend "
                        "package (s3fs, gcsfs, adlfs) must be installed") from exc
                if self.protocol in S3:
                    fs.retries = 1  # one attempt per s3fs call (not an __init__ option): RetryConfig rules
                    if self.transfer.presigned and presigned_usable(self._options):
                        self._presigned = PresignedRanges(
                            lambda path, seconds, fs=fs: fs.sign(path, expiration=seconds),
                            connect_timeout=min(self.transfer.timeout, 10.0), read_timeout=self.transfer.timeout,
                            pool_size=self._pool_size,
                            verify=(self._options.get("client_kwargs") or {}).get("verify"))
                self._root = fs._strip_protocol(self.url).rstrip("/") + "/"
                self._fs = fs
            if self._pool is None:
                def _name_thread() -> None:
                    threading.current_thread().name = f"datacache-io-{next(_thread_ids)}"
                self._pool = ThreadPoolExecutor(self._pool_size, initializer=_name_thread)
            return self._fs, self._pool

    def _bump(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _on_error(self, cls: str, will_retry: bool) -> None:
        with self._lock:
            errors = self._stats["errors"]
            errors[cls] = errors.get(cls, 0) + 1
            if will_retry:
                self._stats["retries"] += 1

    def _call(self, op: str, name: str, fn: Callable[[Any, str], Any], *, started: float | None = None,
              cancelled: Callable[[], bool] | None = None, priority: float | None = None,
              slots: PrioritySlots | None = None) -> Any:
        """Run ``fn(fs, path)`` under the retry policy; errors are translated here. Each attempt
        is one request: a request slot of this process (with a ``priority``: ranged GETs, in plan
        order; ``slots``: another pool of them), then a place in the node's congestion window,
        which learns its outcome."""
        fs, _ = self._ensure()
        path = self._root + name
        started = time.monotonic() if started is None else started

        def attempt() -> Any:
            if self._closed:  # closed during the call (its GET in flight shut by close): no attempt more
                raise StorageError(f"{op}: the store was closed during the call", url=self.url_of(name))
            with (slots or self._requests).hold(priority) if priority is not None else nullcontext(), \
                    self.congestion.request(started + self.retry.deadline, cancelled):
                try:
                    out = fn(fs, path)
                except Exception as exc:
                    self._answered = self._answered or answered(exc)
                    raise
                self._answered = True
                return out
        return retry_call(attempt, self.retry, url=self.url_of(name), op=op,
                          redact=self._redact, started=started, cancelled=cancelled,
                          on_attempt=lambda: self._bump("requests"), on_error=self._on_error,
                          endpoint=self._redact(self.endpoint), unanswered=lambda: not self._answered)

    # -- public API -------------------------------------------------------------------------
    def url_of(self, name: str) -> str:
        """Full URL of the object ``name`` (relative to the store's prefix)."""
        return self.url + _check_name(name)

    def size(self, name: str) -> int:
        """Size in bytes of object ``name`` (one HEAD). Raises NotFoundError if it does not exist."""
        info = self._call("size", name, lambda fs, p: fs.info(p))
        if info.get("type") == "directory":
            raise NotFoundError("size: this is a prefix (directory), not an object", url=self.url_of(name),
                                hint="Check the object name")
        return int(info["size"])

    def exists(self, name: str) -> bool:
        """True if object (or, on file systems, directory) ``name`` exists. Other errors raise."""
        try:
            self._call("exists", name, lambda fs, p: fs.info(p))
            return True
        except NotFoundError:
            return False

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        """``(name, size)`` of every object whose name starts with ``prefix``, recursive, sorted.
        A missing or empty prefix gives ``[]``; a missing bucket raises NotFoundError."""
        base = prefix[: prefix.rfind("/") + 1] if "/" in prefix else ""
        if base:
            _check_name(base.rstrip("/"))
        found = self._call("list", base, lambda fs, p: fs.find(p.rstrip("/") or p, detail=True))
        out = []
        for path, info in found.items():
            path = path.split("://", 1)[-1] if "://" in path else path
            rel = path[len(self._root):] if path.startswith(self._root) else None
            if rel and not rel.endswith("/") and rel.startswith(prefix) and info.get("type", "file") != "directory":
                out.append((rel, int(info.get("size") or 0)))
        return sorted(out)

    def read_range(self, name: str, start: int, end: int, *, priority: float = 0.0,
                   cancelled: Callable[[], bool] | None = None) -> bytes:
        """Bytes ``[start, end)`` of object ``name`` (one ranged GET, retried). ``priority`` and
        ``cancelled``: as for ``read_into``. A read of at most ``SMALL_READ`` bytes (a shard's index
        or header, which the larger reads of that shard wait for) takes no request slot: it costs a
        round trip, not a share of the link, and queued behind 1 MB reads it left the link all but
        idle for the first 0.3 s of a part-mixed cold epoch (each first read of a shard waits for
        its index; ``TransferConfig.range_requests``). It still takes a place in the congestion window."""
        if not 0 <= start <= end:
            raise ValueError(f"bad range [{start}, {end})")
        if start == end:
            return b""
        small = end - start <= SMALL_READ  # a round trip, not a share of the link: no slot
        return self._read_part(name, start, end, None, time.monotonic(), cancelled, None if small else priority,
                               slots=self._range_requests)

    def read_bytes(self, name: str, *, size: int | None = None) -> bytes:
        """The whole object, by parallel ranged GETs. Pass ``size`` (known from a manifest) to skip
        the HEAD. Raises IntegrityError if the object is larger or smaller than ``size``."""
        size = self.size(name) if size is None else size
        buf = bytearray(size)

        def sink(off: int, data: bytes) -> None:
            buf[off:off + len(data)] = data
        self._read_parts(name, size, sink)
        return bytes(buf)

    def read_into(self, name: str, path: str, *, size: int | None = None,
                  on_bytes: Callable[[int], None] | None = None, priority: float = 0.0,
                  cancelled: Callable[[], bool] | None = None) -> int:
        """Read the whole object into the existing local file ``path`` (each part written at its
        offset with ``os.pwrite``, so memory stays ~part_bytes x concurrency); returns the byte count.
        ``on_bytes(n)`` is called (from I/O threads) after each part is written. Lower ``priority``
        values get request slots first (the prefetcher passes each shard's position in its plan).
        ``cancelled()`` (thread-safe, cheap) true abandons the read at once: ReadCancelledError."""
        size = self.size(name) if size is None else size
        fd = os.open(path, os.O_WRONLY)
        try:
            def sink(off: int, data: bytes) -> None:
                view = memoryview(data)
                while view:
                    n = os.pwrite(fd, view, off)
                    view, off = view[n:], off + n
                if on_bytes is not None:
                    on_bytes(len(data))
            self._read_parts(name, size, sink, priority, cancelled)
        finally:
            os.close(fd)
        return size

    def write_bytes(self, name: str, data: bytes) -> None:
        """Create or replace object ``name`` with ``data``, atomically: a reader sees the old object
        or the new one, never a part (one PUT on object stores; on local file systems a temp file in
        the same directory, fsync, ``os.replace``)."""
        data = bytes(data)
        self._call("write", name, lambda fs, p: replace_local(p, data) if self.protocol == "file"
                   else fs.pipe_file(p, data))
        self._bump("bytes_written", len(data))

    def put_file(self, local_path: str, name: str) -> None:
        """Upload the local file ``local_path`` as object ``name``."""
        self._call("put", name, lambda fs, p: fs.put_file(local_path, p))
        self._bump("bytes_written", os.path.getsize(local_path))

    def delete(self, name: str) -> None:
        """Delete object ``name``; deleting a missing object is not an error (as on S3)."""
        try:
            self._call("delete", name, lambda fs, p: fs.rm_file(p))
        except NotFoundError:
            pass

    def delete_many(self, names: list[str]) -> list[tuple[str, Exception]]:
        """Delete objects ``names`` (on the I/O pool, ``concurrency`` at a time); missing ones are
        not an error. Never raises for a failed delete: returns ``(name, error)`` of each failure.
        Not to be called from the store's own I/O threads (it waits on them)."""
        if not names:
            return []
        try:
            _, pool = self._ensure()
        except StorageError as exc:  # closed, or no filesystem: every delete failed
            return [(n, exc) for n in names]

        def one(name: str) -> Exception | None:
            try:
                self.delete(name)
                return None
            except Exception as exc:  # noqa: BLE001 - reported to the caller, per name
                return exc
        results = list(pool.map(one, names))
        return [(n, e) for n, e in zip(names, results) if e is not None]

    def stats(self) -> dict[str, Any]:
        """Counters of this process: requests (attempts), retries, bytes_read, bytes_written,
        errors (count of failed attempts by datacache error class); and ``congestion``: the
        congestion state of this prefix (node-wide once shared, see ``share_congestion``)."""
        with self._lock:
            out = {**self._stats, "errors": dict(self._stats["errors"])}
        out["congestion"] = self.congestion.stats()
        return out

    def close(self) -> None:
        """Release the thread pool and filesystem. Idempotent; later calls raise StorageError."""
        with self._lock:
            self._closed = True
            pool, self._pool, self._fs = self._pool, None, None
            presigned, self._presigned = self._presigned, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=False, cancel_futures=True)
        if presigned is not None:
            presigned.close()
        self.congestion.close()

    # -- ranged reads -----------------------------------------------------------------------
    def _read_part(self, name: str, start: int, end: int, total: int | None, started: float,
                   cancelled: Callable[[], bool] | None, priority: float = 0.0,
                   slots: PrioritySlots | None = None) -> bytes:
        """GET ``[start, end)``; for the last part of an object of expected size ``total`` one extra
        byte is asked for, so an object that grew is detected."""
        want = end - start
        extra = 1 if total is not None and end == total else 0

        def get(fs: Any, path: str) -> bytes:
            try:
                data = self._presigned.get(path, start, end + extra, cancelled) if self._presigned else None
                if data is None:  # not asked by presigned URL, or an answer left to s3fs
                    data = cat_range(fs, path, start, end + extra, cancelled, self.url_of(name))
            except Exception as exc:
                if error_code(exc) != "InvalidRange":
                    raise
                data = b""  # 416: the range starts past the object's end; the size check below says why
            if len(data) > want:
                raise IntegrityError(f"object is larger than the expected {total} bytes", url=self.url_of(name),
                                     hint="The object was replaced; rebuild or refresh the manifest")
            if len(data) < want:
                actual = int(fs.info(path)["size"])
                if actual < end:
                    raise IntegrityError(
                        f"object is {actual} bytes, expected at least {end}", url=self.url_of(name),
                        hint="The object was replaced or truncated; rebuild or refresh the manifest")
                raise ShortReadError(f"short read: got {len(data)} of {want} bytes at offset {start}")
            return data

        # the part needed soonest gets a request slot first
        data = self._call("read", name, get, started=started, cancelled=cancelled, priority=priority, slots=slots)
        self._bump("bytes_read", len(data))
        return data

    def _read_parts(self, name: str, size: int, sink: Callable[[int, bytes], None], priority: float = 0.0,
                    cancelled: Callable[[], bool] | None = None) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        started = time.monotonic()
        if size == 0:  # no satisfiable range: a plain GET checks existence and emptiness
            data = self._call("read", name, lambda fs, p: fs.cat_file(p), started=started)
            if data:
                raise IntegrityError("object is larger than the expected 0 bytes", url=self.url_of(name),
                                     hint="The object was replaced; rebuild or refresh the manifest")
            return
        _, pool = self._ensure()
        nested = threading.current_thread().name.startswith("datacache-io-")  # an I/O thread: no nesting
        try:
            read_parts(size, self.transfer.part_bytes, self.transfer.concurrency, None if nested else pool,
                       lambda start, end, stop: self._read_part(name, start, end, size, started, stop, priority),
                       sink, cancelled)
        except (CancelledError, RuntimeError) as exc:
            if self._closed:
                raise StorageError("read: the store was closed during the read", url=self.url_of(name)) from exc
            raise
