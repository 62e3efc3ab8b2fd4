"""The peer protocol's constants, shared by the server and the client (no imports: the bottom of
the peer layer). Version 1: ``/v1/shard/<dataset id>/<hash>/<shard name>[?fetch=1]`` and
``/v1/held/<dataset id>`` (``datacache.peer.server``); raw bytes both ways, never pickle."""
from __future__ import annotations

__all__ = ["BUDGET", "CHUNK", "FETCHING", "MAX_HELD"]

CHUNK = 1 << 20  # bytes read or written at a time
MAX_HELD = 1 << 22  # entries of a held summary (8 bytes each: 32 MB)
FETCHING = "X-Datacache-Fetching"  # response header: the owner downloads the shard for the asker
BUDGET = "X-Datacache-Budget"  # held summary's header: the node cache's configured bytes (RAM + SSD)
