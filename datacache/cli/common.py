"""Shared pieces of the ``datacache`` subcommands: context, progress, thread pool, errors, and the
argument types.

The ``datacache`` command line's argument types: each parses one value or raises
``argparse.ArgumentTypeError`` with a line saying what was expected (argparse prints it as a
usage error, exit code 2). Pure functions.
"""
from __future__ import annotations

import argparse
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
from typing import Any, TypeVar

from ..config import CacheConfig, parse_size
from ..hashing import hash_file
from ..progress import Progress
from ..store.storage import Store, check_url

__all__ = ["Ctx", "UsageError", "fraction", "nonneg_int", "pos_int", "size", "url"]


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


_N = TypeVar("_N", int, float)


def size(text: str) -> int:
    """A byte size such as ``64MB`` or ``1.5GiB`` (``datacache.config.parse_size``)."""
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert value is not None
    return value


def _number(text: str, kind: Callable[[str], _N], what: str, ok: Callable[[_N], bool], rule: str) -> _N:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
    return value


def nonneg_int(text: str) -> int:
    """An integer >= 0."""
    return _number(text, int, "an integer", lambda v: v >= 0, ">= 0")


def pos_int(text: str) -> int:
    """An integer >= 1."""
    return _number(text, int, "an integer", lambda v: v >= 1, ">= 1")


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    return _number(text, float, "a number in (0, 1]", lambda v: 0 < v <= 1, "in (0, 1]")


def url(text: str) -> str:
    """A URL or local path datacache can open (``datacache.store.storage.check_url``: not ``s3:/bucket``)."""
    try:
        return check_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
