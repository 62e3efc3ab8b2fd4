"""Shared pieces of the ``datacache`` subcommands: context, progress, thread pool, errors."""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


from .config import CacheConfig
from .progress import Progress
from .hashing import hash_file
from .storage import Store

__all__ = ["Ctx", "UsageError"]


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
def _run_pool(items: Sequence[Any], fn: Callable[[Any], None], threads: int, stop: threading.Event,
              name: str) -> None:
    """``fn(item)`` for every item on a thread pool, started in order. The first error (or Ctrl-C in
    the main thread) sets ``stop``, cancels what has not started, waits for the running tasks (which
    pass ``stop.is_set`` as their transfers' ``cancelled``, so GETs in flight are abandoned at once)
    and is re-raised. A second Ctrl-C during that short wait is ignored, so the wait (which removes
    partial files) completes."""
    if not items:
        return
    pool = ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix=name)
    futures = []
    try:
        futures = [pool.submit(fn, item) for item in items]
        for f in as_completed(futures):
            f.result()
    except BaseException as exc:
        stop.set()
        with _sigint_ignored(isinstance(exc, KeyboardInterrupt)):
            for f in futures:
                f.cancel()
            pool.shutdown(wait=True)
        raise
    pool.shutdown(wait=True)


@contextmanager
def _sigint_ignored(ignore: bool) -> Iterator[None]:
    """SIGINT ignored inside (main thread only): Ctrl-C again while stopping changes nothing."""
    if not ignore or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _watch(stop: threading.Event, progress: Progress | None) -> Callable[[int], None]:
    def on_bytes(n: int) -> None:
        if stop.is_set():
            raise _Stopped()
        if progress is not None:
            progress.add(n)
    return on_bytes


def _download(store: Store, name: str, size: int, tmpdir: str, on_bytes: Callable[[int], None],
              cancelled: Callable[[], bool] | None = None) -> tuple[str, str]:
    """Read object ``name`` into a temporary file under ``tmpdir``; returns (path, content hash).
    ``cancelled()`` true abandons the transfer at once (see ``Store.read_into``)."""
    fd, path = tempfile.mkstemp(dir=tmpdir, prefix=".dl-")
    os.close(fd)
    try:
        store.read_into(name, path, size=size, on_bytes=on_bytes, cancelled=cancelled)
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
