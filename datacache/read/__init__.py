"""The read layer: one consumer's epoch, from its plan to samples.

Guarantees:
- one path for every shard: fetched through the node cache, then read locally (``shard_source``);
- the node's schedule is told to the cache before the reads (``node_schedule``), so eviction knows
  the future;
- the prefetcher keeps at most its byte budget ahead of the consumer and hands items over in plan
  order (``prefetch``); a worker's exception reaches the consumer with its traceback;
- batched loops make their batches on one thread ahead of the loop (``batcher``), closed with the
  consumer, so an abandoned loop stops when its dataset is closed or iterated again;
- ``close()`` is idempotent and never hangs; a worker whose training process died stops fetching
  (``lifecycle``).

May import: ``cache``, ``store``, ``plan``, ``datacache.readers`` and the base modules. Never ``mixing``,
``pytorch`` or ``cli``.
"""

__all__: list[str] = []
