"""Batches carried from a DataLoader worker to the training process a few at a time, handed out one by one.

torch's DataLoader pays a fixed price for every item a worker hands over, whatever its size: the
worker loop's turn, the queue's pickling, pipe and feeder thread, the training process's
reordering, its checks of the workers' status and, with ``pin_memory``, a turn of the pinning
thread. With batches that are only a slot of a shared ring (``datacache.pytorch.batches``) that
price is most of what a batch costs the two processes. ``datacache.DataLoader`` therefore has its
workers (``bundled``) send their batches as one :class:`Bundle` of up to ``size`` batches, the
first of each epoch alone and then twice as many each time up to ``size`` (so the epoch's first
batch waits for no other), and the training process (``Unbundler``) hands them out **in the order
torch's turns would have given** unbundled: worker 0's first batch, worker 1's first, ..., worker
0's second, skipping a worker whose batches have ended. The order, and so the resume state
counted from the batches handed out (``datacache.pytorch.rounds``), is the same as one batch per
item.

Back-pressure: the training process holds at most one bundle per worker that it has not yet
handed out wholly (it takes the next item from torch only when the worker whose turn it is has no
batch left here); torch asks each worker for ``prefetch_factor`` items ahead, so a worker has at
most ``(prefetch_factor + 1) * size`` batches out beyond the one it is making: the ring's slots
are counted for that (``ring_slots``).

A worker's last item says so (``last``; an empty bundle where its batches ended on a bundle's
edge), so the training process never waits for a batch that will not come, and never takes more
than a bundle ahead from the other workers.

Thread safety: ``bundled`` runs in the worker's iterating thread; an ``Unbundler`` is used by
one thread at a time (the training loop's or its read-ahead's, as torch's iterator).
"""
from __future__ import annotations

import collections
import pickle
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch

from .collate import tensors

__all__ = ["BUNDLE", "Bundle", "Deferred", "Unbundler", "bundled", "ring_slots"]

BUNDLE = 4  # batches per bundle at most: three quarters of torch's per-item price saved, a few ring slots more


class Bundle(NamedTuple):
    """Batches of loader worker ``worker`` in their order; ``last``: it has no more this epoch.
    A named tuple, so that torch's ``default_convert`` (in the worker) and ``pin_memory`` (in the
    training process) treat each batch in it as they would treat the batch alone."""

    worker: int
    last: bool
    batches: list[Any]


def bundled(batches: Iterable[Any], worker: int, size: int = BUNDLE, *, defer: bool = True) -> Iterator[Bundle]:
    """``batches`` as bundles of 1, 2, 4, ... up to ``size`` batches, the last one marked (an empty
    one where the batches end on a bundle's edge, or where there are none). ``defer``: a batch
    that holds no tensor of its own (a ring batch: see ``Deferred``) is sent pickled."""
    bundle: list[Any] = []
    want = 1
    try:
        for batch in batches:
            bundle.append(Deferred.of(batch) if defer else batch)
            if len(bundle) == want:
                yield Bundle(worker, False, bundle)
                bundle, want = [], min(2 * want, size)
    except Exception:
        if bundle:  # the batches made before the error go first, as they would have one by one
            yield Bundle(worker, False, bundle)
        raise
    yield Bundle(worker, True, bundle)


class Deferred:
    """A batch pickled in the worker and unpickled when the training process hands it out
    (``load``), not when the bundle arrives: unpickling a ring batch makes its ``bytes`` and ``str``
    values (copies out of the slot), and a bundle's all at once would take fresh memory from the
    system for each bundle where one batch's reuses what the previous one gave back. Only for
    batches whose pickle holds no tensor (a tensor's storage crosses by a descriptor torch passes
    with the bundle's own pickle); not under ``pin_memory``, whose thread pins the batches as they
    arrive."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    @staticmethod
    def of(batch: Any) -> Any:
        """``batch`` deferred where it holds no tensor, else itself."""
        if next(tensors(batch), None) is not None:
            return batch
        return Deferred(pickle.dumps(batch, pickle.HIGHEST_PROTOCOL))

    def load(self) -> Any:
        return pickle.loads(self.data)


def ring_slots(prefetch_factor: int | None, base: int, size: int = BUNDLE) -> int:
    """Slots a worker's batch ring needs so that bundling takes no more of them than before:
    ``base`` plus the batches beyond one per item that torch's prefetch, the bundle being handed
    out and the one being made can hold."""
    return base + ((prefetch_factor or 2) + 2) * (size - 1)


class Unbundler:
    """The next batch of ``num_workers`` workers' bundles (``step``: the next item of torch's
    iterator), in the unbundled order (see the module docstring); raises ``StopIteration`` at the
    end of the epoch and whatever ``step`` raises (a worker's error, with its traceback).

    ``batch_range``: the profiler range torch's iterator opens around each item it hands out; under
    a profiler, a batch handed out from a bundle already here gets one of its own, so that every
    batch still shows as one DataLoader range."""

    def __init__(self, step: Callable[[], Any], num_workers: int,
                 batch_range: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
        self._step, self._range = step, batch_range
        self._held: list[collections.deque[Any]] = [collections.deque() for _ in range(num_workers)]
        self._ended = [False] * num_workers
        self._turn = 0  # the worker whose batch is handed out next

    def __call__(self) -> Any:
        if self._range is not None and torch.autograd._profiler_enabled() and self._ready():
            with self._range():
                return self._next()
        return self._next()

    def _ready(self) -> bool:
        """Whether the next batch is here already (no item to take from torch for it)."""
        w, p = len(self._held), self._turn
        for _ in range(w):
            if self._held[p]:
                return True
            if not self._ended[p]:
                return False
            p = (p + 1) % w
        return False

    def _next(self) -> Any:
        w = len(self._held)
        for _ in range(w):
            p = self._turn
            self._turn = (p + 1) % w
            held = self._held[p]
            while not held and not self._ended[p]:
                try:
                    self._take()
                except Exception:
                    self._ended[p] = True  # its error (see _take) ended its batches, as torch's worker loop
                    raise
            if held:
                batch = held.popleft()
                return batch.load() if isinstance(batch, Deferred) else batch
        raise StopIteration

    def _take(self) -> None:
        """One item from torch: its batches to their worker's queue. torch raises a worker's error
        in place of its item; that item is the one due, as the worker whose turn it is has no batch
        left here and torch takes the workers' items in the same turns: the error comes after
        the batches before it (``bundled`` sends a worker's batches made before its error first)."""
        try:
            item = self._step()
        except StopIteration:
            self._ended = [True] * len(self._ended)
            return
        if not isinstance(item, Bundle):
            raise TypeError(f"datacache: a DataLoader worker sent {type(item).__name__}, not a bundle of batches: "
                            "its dataset was not configured by this datacache.DataLoader")
        self._held[item.worker].extend(item.batches)
        if item.last:
            self._ended[item.worker] = True
