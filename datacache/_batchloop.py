"""Batched mode's loop: a consumer's samples collated into whole batches by a batcher thread.

A batcher thread (one ``Prefetcher.bounded``, ``_AHEAD`` batches ahead) collates the next batches
while the current one is used, so the training loop (or a DataLoader worker's loop, sending the
last batch) only ever takes a ready batch. The plan position after each batch handed out is
reported through ``mark`` (what a resume state must record, not what the batcher has read).
Used by one iterating thread; the batcher thread is the only other one and is closed, with the
consumer, when the loop ends or is abandoned.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from ._consumer import Consumer
from ._rounds import WorkerBatches
from .prefetch import Prefetcher

__all__ = ["batched"]

_AHEAD = 4  # batches collated ahead of the one handed out


def batched(consumer: Consumer, batches: WorkerBatches, collate: Callable[[list[Any]], Any],
            transform: Callable[[Any], Any] | None, mark: Callable[[int], None]) -> Iterator[Any]:
    """Yield ``consumer``'s samples (``transform``ed) as ``batches`` says, each ``collate``d;
    ``mark(position)`` before each batch is yielded (and once with the start position)."""
    samples = iter(consumer)
    cuts = batches.cuts

    def make_batch(j: int) -> tuple[Any, int] | None:
        n = batches.size if cuts is None else cuts[j] - consumer.consumed  # per_stream: cut at stream changes
        batch = [transform(s) if transform else s for s in itertools.islice(samples, n)]
        if not batch:
            return None
        return collate(batch), consumer.consumed

    batcher: Prefetcher[int, Any] = Prefetcher.bounded(range(batches.count), make_batch, ahead=_AHEAD,
                                                       name=f"{consumer.prefetcher.name}-batch")
    mark(consumer.skip)
    try:
        for item in batcher:
            if item is None:
                break
            mark(item[1])
            yield item[0]
    finally:
        consumer.close()  # first: wakes the batcher thread if it waits on the consumer (Ctrl-C)
        batcher.close()
