"""The batching stage over a consumer: one thread makes the next batches while the current one is used.

``batches`` runs ``make_batch`` (which takes the consumer's next samples or steps and makes a
batch of them) on one thread (``Prefetcher.bounded``, named ``<consumer's name>-batch``), at most
``AHEAD`` batches ahead of the one handed out, so that the loop taking them (the training loop, or
a DataLoader worker's loop sending the last one) only ever takes a ready batch. ``mark(position)``
reports the plan position after each batch handed out (what a resume state must record, not what
the thread has read), and once the start position.

Lifetime: the thread ends with the loop (its end, or the generator closed), and also when the
consumer is closed by anyone (``Consumer.attach``): a loop abandoned in a reference cycle, which
only the garbage collector would close, stops when its dataset starts its next iteration or is
closed. Used by one iterating thread; the batcher thread is the only other one.

``finish`` runs once the loop ends and the thread has stopped: ``make_batch`` reads the consumer
through a generator of its own, which the last batch leaves suspended after its last sample (it is
never asked for one more). Its open runs keep their samples until it is closed, and a sample that
is a view of a shard's mapping keeps that shard's reader from its whole-shard table
(``readers._cowmap``) for as long as the stage is referenced.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .prefetch import Prefetcher

if TYPE_CHECKING:  # the stage sits beside the consumer, not above it in the import graph
    from .consumer import Consumer

__all__ = ["AHEAD", "batches"]

AHEAD = 4  # batches made ahead of the one handed out


def batches(consumer: "Consumer", count: int, make_batch: Callable[[int], tuple[Any, int] | None],
            mark: Callable[[int], None], *, finish: Callable[[], None] | None = None) -> Iterator[Any]:
    """Yield up to ``count`` batches: ``make_batch(j)`` gives (batch, plan position after it), or
    None once the consumer has no more; ``mark`` and ``finish`` as the module docstring says."""
    batcher: Prefetcher[int, Any] = Prefetcher.bounded(range(count), make_batch, ahead=AHEAD,
                                                       name=f"{consumer.prefetcher.name}-batch")
    consumer.attach(batcher)
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
        if finish is not None and not batcher.running():
            finish()
