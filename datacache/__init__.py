"""datacache: a node-local RAM+SSD cache and a clairvoyant prefetcher that keep GPUs fed.

Public API (guarded by ``tests/test_api.py``)::

    write_dataset, DatasetWriter            write a dataset to any fsspec URL
    Manifest, ShardInfo, load_manifest      the dataset manifest
    open_store, Store                       storage access (the only fsspec user)
    NodeCache, CacheHandle                  the node cache
    LRUPolicy, ClairvoyantPolicy, Schedule  eviction policies
    StreamingDataset                        the drop-in IterableDataset
    DataLoader                              torch's DataLoader signature, batching in the dataset (the fast path)
    Stream                                  one source of a mixed StreamingDataset(streams=[...])
    CachedDataset                           map-style, for your own sampler (plan(indices))
    CacheConfig, PrefetchConfig, TransferConfig, RetryConfig, parse_size
    PeerConfig                              the peer tier: nodes serve their cached shards to each other
    DatacacheError and subclasses           see datacache.errors
"""
from __future__ import annotations

from ._version import __version__
from .cache.eviction import ClairvoyantPolicy, LRUPolicy, Schedule
from .cache.node import CacheHandle, NodeCache
from .config import CacheConfig, PeerConfig, PrefetchConfig, RetryConfig, TransferConfig, parse_size
from .errors import (
    CacheError,
    DatacacheError,
    DatasetExistsError,
    IntegrityError,
    ManifestError,
    NotFoundError,
    PermissionDeniedError,
    ReaderError,
    StorageError,
    ThrottledError,
    TransientStorageError,
    UnreachableError,
)
from .manifest import Manifest, ShardInfo, load_manifest
from .mixing.streams import Stream
from .store.storage import Store, open_store
from .writer import DatasetWriter, write_dataset


def __getattr__(name: str) -> object:
    # StreamingDataset subclasses torch's IterableDataset: import torch only when it is used, so
    # the CLI and the cache start fast.
    if name == "StreamingDataset":
        from .pytorch.dataset import StreamingDataset

        return StreamingDataset
    if name == "DataLoader":
        from .pytorch.loader import DataLoader

        return DataLoader
    if name == "CachedDataset":
        from .pytorch.mapped import CachedDataset

        return CachedDataset
    raise AttributeError(f"module 'datacache' has no attribute {name!r}")


__all__ = [
    "__version__",
    "write_dataset", "DatasetWriter",
    "Manifest", "ShardInfo", "load_manifest",
    "open_store", "Store",
    "NodeCache", "CacheHandle",
    "LRUPolicy", "ClairvoyantPolicy", "Schedule",
    "StreamingDataset", "DataLoader", "CachedDataset", "Stream",
    "CacheConfig", "PrefetchConfig", "TransferConfig", "RetryConfig", "PeerConfig", "parse_size",
    "DatacacheError", "StorageError", "TransientStorageError", "ThrottledError", "NotFoundError",
    "PermissionDeniedError", "UnreachableError",
    "ManifestError", "IntegrityError", "ReaderError", "CacheError", "DatasetExistsError",
]
