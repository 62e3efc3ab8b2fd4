"""The mixing layer: several datasets read as one (``Stream`` and its weight).

Guarantees: each epoch draws exact per-stream counts (``streams``); the mixed epoch order is a pure
function of the seed (``plan``) and is read through each stream's own shard source
(``source``), so the cache, the bound and exactly-once hold per stream.

May import: ``read``, ``plan``, ``cache``, ``store`` and the base modules. Never ``pytorch`` or ``cli``.
"""
from .streams import Stream

__all__ = ["Stream"]
