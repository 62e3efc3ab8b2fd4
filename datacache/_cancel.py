"""Ranged GETs that can be abandoned while in flight (used by :mod:`datacache.storage`).

On an async fsspec filesystem (s3fs, gcsfs...) the GET runs as a task on fsspec's event loop and
the calling thread waits for it in ``_POLL`` steps, looking at ``cancelled()`` between them: once
it is true the task is cancelled (its connection is dropped) and ``ReadCancelledError`` is raised.
Other filesystems are called directly (local reads are short). Thread-safe; no fsspec import.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from .errors import ReadCancelledError

__all__ = ["cat_range"]

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
