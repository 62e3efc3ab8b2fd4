"""Shared pieces of the ``datacache`` subcommands: context, progress, thread pool, errors."""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from .config import CacheConfig
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
_PLAIN_STEP, _PLAIN_SECONDS = 0.1, 30.0  # off a terminal: one line per 10 % done, or per 30 s
_PLAIN_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


class _Progress:
    """A thread-safe tqdm byte bar (MB, MB/s, ETA) with an item counter as postfix, on stderr.

    When stderr is not a terminal (a log file, a pipe) there is no bar (its ``\r`` redraws would
    fill the log): a plain line is written each time another 10 % is done or 30 s have passed, and
    one at the end."""

    def __init__(self, ctx: Ctx, total: int, desc: str, items: int, noun: str = "shards") -> None:
        self._plain = not ctx.quiet and not _isatty(sys.stderr)
        self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000,
                         disable=ctx.quiet or self._plain, file=sys.stderr, dynamic_ncols=True, leave=False)
        self._lock = threading.Lock()
        self.items, self.done, self.noun, self.desc = items, 0, noun, desc
        self._total, self._n, self._t0 = total, 0, time.monotonic()
        self._line_n, self._line_t = (0, 0), self._t0  # (bytes, items) of the last plain line
        self._closed = False
        self._postfix()

    def _postfix(self) -> None:
        self._bar.set_postfix_str(f"{self.done}/{self.items} {self.noun}", refresh=False)

    def _plain_line(self, final: bool = False) -> str | None:
        """The plain line due now, if any (called with the lock held; printed outside it)."""
        now = time.monotonic()
        if not self._plain or (self._n, self.done) == self._line_n:
            return None
        if not final and (self._n - self._line_n[0] < _PLAIN_STEP * self._total
                          and now - self._line_t < _PLAIN_SECONDS):
            return None
        self._line_n, self._line_t = (self._n, self.done), now
        return tqdm.format_meter(self._n, self._total, now - self._t0, prefix=self.desc, unit="B", unit_scale=True,
                                 unit_divisor=1000, postfix=f"{self.done}/{self.items} {self.noun}",
                                 bar_format=_PLAIN_FORMAT)

    @staticmethod
    def _print(line: str | None) -> None:
        if line is not None:
            print(line, file=sys.stderr, flush=True)

    def add(self, n: int) -> None:
        with self._lock:
            self._bar.update(n)
            self._n += n
            line = self._plain_line()
        self._print(line)

    def item_done(self) -> None:
        with self._lock:
            self.done += 1
            self._postfix()
            self._bar.refresh()

    def grow(self, nbytes: int, items: int = 1) -> None:
        with self._lock:
            self._bar.total = (self._bar.total or 0) + nbytes
            self._total += nbytes
            self.items += items
            self._postfix()

    def close(self) -> None:
        """Remove the bar (or write the last plain line). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            line = self._plain_line(final=True)
        self._bar.close()
        self._print(line)


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


def _watch(stop: threading.Event, progress: _Progress | None) -> Callable[[int], None]:
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
