"""Helpers of ``storage`` that need no fsspec import: the options a filesystem is opened with, what
a forked child keeps of its parent's filesystems, an atomic local replace, and the parallel ranged
read of one object (``read_parts``). Thread-safe: module state is only appended to, under the GIL.
"""
from __future__ import annotations

import os
import tempfile
import threading
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import suppress
from typing import Any, Callable

from .config import TransferConfig

__all__ = ["S3", "abandon_inherited", "endpoint_of", "fs_options", "replace_local", "read_parts", "shared_loader"]

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


def replace_local(path: str, data: bytes) -> None:
    """Atomically create or replace the local file ``path``: temp file, fsync, ``os.replace``."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


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
