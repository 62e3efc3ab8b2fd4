"""The training process maps the node's RAM tier files while a cold epoch lands them.

A batch's large ``bytes`` values stay in the cached shard files, and the training process copies
each one from its own mapping of its file (``datacache.pytorch.crossread``). The first copy from
each page of a file newly mapped there takes a page fault: in the first warm epoch, one fault per
few pages of every shard of the node, all on the training loop's thread, which that epoch's
values already keep busy. In the cold epoch before it, the same process mostly waits for the
link. ``TierMapper`` moves the mapping into that wait: woken as batches arrive (``notify``), it
looks up which of the node's shards the RAM tier holds now (one index read,
``NodeCache.ram_files``) and maps each new one with all its pages (``crossread.FILES.adopt``), on
its own thread, with the GIL released while the kernel maps them.

Bounds: one look per ``_EVERY`` seconds at most, however fast batches come (a look costs one
index read of the shards not yet mapped); files are only added while ``FILES`` has room, never
one dropped for another; once every shard is mapped, or ``FILES`` refuses one for good, or a
landed shard is not read in place (``worth``: a compressed shard's values are decompressed, never
copied from its file), the thread ends. ``notify(last=True)`` (the epoch's end) makes one last
look at once. The mappings only spare later copies their faults: a value is still copied from a
mapping only where the worker sends that very file's identity (``crossread``), so a file evicted
or replaced since it was mapped costs its room until ``FILES.prune`` and is never read.

Thread-safe: ``notify`` from the training loop's thread, ``close`` (idempotent; back once the one
file being mapped, if any, is done) from any. Started after the DataLoader's fork, as a head
start's threads are (``datacache.read.headstart``).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence

from ..cache.node import NodeCache
from .crossread import FILES

__all__ = ["TierMapper"]

log = logging.getLogger("datacache.pytorch.tiermap")

_EVERY = 0.05  # seconds between two looks at the index, at least


class TierMapper:
    """Maps ``keys``' RAM tier files of ``cache`` into this process (``crossread.FILES``) as they
    land (see the module docstring). ``shards[i]`` is ``keys[i]``'s shard, asked of ``worth``
    once, for the first that lands: whether its values are read in place."""

    def __init__(self, cache: NodeCache, keys: Sequence[str], shards: Sequence[int], *,
                 worth: Callable[[int], bool], name: str) -> None:
        self._cache, self._name = cache, name
        self._worth: Callable[[int], bool] | None = worth
        self._pending = dict(zip(keys, shards))
        self._wake, self._stop = threading.Event(), threading.Event()
        self._last = False
        self._thread: threading.Thread | None = None
        self.mapped = 0

    def start(self) -> None:
        """Start the thread, which looks once at once; idempotent."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def notify(self, last: bool = False) -> None:
        """A batch arrived (``last``: the epoch's batches are over): look again soon. No I/O."""
        if last:
            self._last = True
        self._wake.set()

    def close(self) -> None:
        """Stop looking; back once the file being mapped, if any, is. Idempotent. While the
        interpreter exits (a dataset closed by its finalizer) it does not wait: the daemon thread
        can no longer run to its end then, and a join would never return."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and not sys.is_finalizing():
            thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (every shard mapped, or nothing more to do); whether it has."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is not None and not thread.is_alive()

    def _run(self) -> None:
        try:
            checked = None
            while self._pending and not self._stop.is_set():
                if checked is not None:
                    self._wake.wait()
                    wait = _EVERY - (time.monotonic() - checked)
                    if not self._last and wait > 0 and self._stop.wait(wait):
                        return
                    self._wake.clear()
                checked = time.monotonic()
                last = self._last
                if not self._look() or last:
                    return
        except Exception as exc:  # noqa: BLE001 - an optimisation: the epoch reads the same without it
            log.debug("%s: stopped (%s)", self._name, exc)

    def _look(self) -> bool:
        """Map the shards the RAM tier holds now; whether to go on."""
        keys = list(self._pending)
        for key, path in zip(keys, self._cache.ram_files(keys)):
            if self._stop.is_set():
                return False
            if path is None:
                continue
            if self._worth is not None:  # asked once, of the first shard that lands
                if not self._worth(self._pending[key]):
                    return False
                self._worth = None
            got = FILES.adopt(path)
            if got is None:
                return False
            if got:
                del self._pending[key]
                self.mapped += 1
        return True
