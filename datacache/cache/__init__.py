"""The cache layer: ``NodeCache``, a RAM tier then an SSD tier, shared by every process of a node.

Guarantees:
- one fetch per key in flight across the node's threads and processes (a kernel lock per key);
- an entry is complete and verified against its hash, or absent: a crash leaves nothing else
  (temp file, fsync, ``os.replace``; partial copies keep their data and their state as one unit);
- an entry a reader has pinned is never evicted or removed from under it;
- eviction is Belady's MIN over the schedules every dataset of the node publishes (``node_policy``).

The cache takes a ``fetch`` callable and imports no network code (fsspec's ``caching`` style).
May import: the base modules and ``datacache.readers`` (a partial copy reads a shard's layout).
Never ``store``, ``plan``, ``read`` or anything above them.

Advanced API: ``NodeCache``, ``CacheHandle`` and the eviction policies (also exported by ``datacache``).
"""
from .eviction import ClairvoyantPolicy, EvictionPolicy, LRUPolicy, Schedule
from .node import CacheHandle, NodeCache

__all__ = ["CacheHandle", "ClairvoyantPolicy", "EvictionPolicy", "LRUPolicy", "NodeCache", "Schedule"]
