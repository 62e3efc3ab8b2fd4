"""The peer tier: the job's nodes serve their cached shards to each other, between the node cache
and the store (``datacache.PeerConfig``; off unless peers are configured).

Guarantees:
- a shard the node cache lacks comes from a peer that holds it, else from its owner (rendezvous
  hashing, ``placement``), which downloads it once for the whole job, else from the store;
- peer bytes are verified against the manifest's xxh3-128 hash before the cache sees them; a
  corrupt, cut, stalled, refused or missing answer goes on to the next source within the deadlines
  of ``PeerConfig`` (``tier``), and slow holders are hedged;
- every request is signed with the job's secret (HMAC over method, path and time, ``auth``); the
  server answers 401/403 and no byte otherwise, names content only by (dataset id, hash, shard
  name) looked up in the cache's index (never a path), speaks no pickle, caps sizes, binds to the
  node's own address, and never logs or shows a token;
- one server per node, a thread of the node's first datacache process, taken over by another
  when that one dies (a kernel lock), none in DataLoader workers (``server``).

May import: the base modules and ``cache`` (the server reads the node cache). Never ``store``,
``plan``, ``read`` or anything above them: the read layer hands the tier the store's download as a
callable (``PeerTier.fetch_into``), as it hands the cache its fetch.
"""
from .membership import Membership, resolve
from .server import PeerServer, register, serve
from .tier import PeerTier

__all__ = ["Membership", "PeerServer", "PeerTier", "register", "resolve", "serve"]
