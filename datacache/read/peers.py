"""The read layer's side of the peer tier (``datacache.peer``): attaching it to a dataset's shard
sources, what the node keeps for the job, and its figures.

- ``attach``: resolve a ``PeerConfig`` (off: nothing changes), give each ``ShardSource`` a
  ``PeerTier`` whose owners follow the plan (node-sticky placement: a shard's owner is the node that
  reads it, ``plan.node_assign``, so nothing is kept twice; global placement: rendezvous hashing),
  register the sources with this process's server, start the node's server (``serve``: once per
  node; never in a DataLoader worker), wait for the other nodes' servers (``PeerConfig.join_timeout``)
  and fit the owners to the nodes' cache sizes they report (``datacache.peer.placement.fit``; a
  single dataset: the streams of a mix share the caches).
- ``owned_keys``: the cache keys this node keeps for the job (``tell_plan(owned=...)``).
- ``with_cluster_times``: a node schedule with the next uses, anywhere in the job, of the shards this
  node owns but does not read itself (global placement): the cache ranks them by when a peer needs them.
- ``peer_stats``: ``stats()["peers"]`` from the node cache's counters.

Pure functions over the plan and the sources, except ``attach`` (it may start the server thread).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..cache.eviction import Schedule
from ..config import PeerConfig
from ..dist import DistInfo
from ..manifest import Manifest
from ..peer.membership import Membership, resolve
from ..peer.server import register, serve
from ..peer.tier import PeerTier
from ..plan.epoch import PlanSpec
from ..plan.node_assign import assign_nodes
from .node_schedule import node_schedule
from .shard_source import ShardSource

__all__ = ["attach", "owned_keys", "with_cluster_times", "peer_stats", "PEER_STATS"]

log = logging.getLogger("datacache.peer")
PEER_STATS = ("bytes_from_peers", "bytes_from_store", "bytes_served", "served", "corrupt", "fallbacks", "hedged",
              "refused")


def attach(sources: Sequence[ShardSource], cfg: PeerConfig | None, dist: DistInfo, *, placement: str = "global",
           num_nodes: int = 1, seed: int = 0) -> Membership | None:
    """Give ``sources`` the peer tier of ``cfg`` (default: ``PeerConfig()``, from the environment)
    and start the node's server; the membership, or None when the tier is off."""
    cfg = cfg if cfg is not None else PeerConfig()
    membership = resolve(cfg, dist)
    if membership is None:
        return None
    for src in sources:
        m = src.manifest
        owner = None
        if placement == "node" and num_nodes > 1 and num_nodes == len(membership.peers):
            owner = assign_nodes(np.array([s.bytes for s in m.shards], dtype=np.int64), num_nodes, seed,
                                 share_dir=src.cache.control_dir)
        src.peers = PeerTier(membership, src.cache, m.dataset_id, [s.name for s in m.shards],
                             [s.bytes for s in m.shards], [s.hash for s in m.shards], owner=owner)
        register(m.dataset_id, src)
    if sources:
        serve(sources[0].cache, membership)
        silent = sources[0].peers.join(cfg.join_timeout) if sources[0].peers is not None else []
        if silent:
            log.warning("datacache: peers %s did not answer within %.0f s (PeerConfig.join_timeout); their shards "
                        "come from elsewhere until they do", ", ".join(silent), cfg.join_timeout)
        tier = sources[0].peers
        if len(sources) == 1 and tier is not None:  # owners fitted to the cache sizes the nodes reported
            tier.fit_owners(int(sources[0].cache.config.ram_bytes) + int(sources[0].cache.config.ssd_bytes))
    return membership


def owned_keys(sources: Sequence[ShardSource]) -> dict[str, frozenset[str]]:
    """Per dataset, the cache keys this node owns (empty without the peer tier)."""
    out = {}
    for src in sources:
        if src.peers is not None and src.peers.membership.me >= 0:
            out[src.manifest.dataset_id] = frozenset(src.manifest.cache_key(int(i)) for i in src.peers.owned())
    return out


def with_cluster_times(times: Schedule, manifest: Manifest, counts: np.ndarray, spec: PlanSpec,
                       owned: frozenset[str], share_dir: str | None) -> Schedule:
    """``times`` plus, for each owned key, when any rank of the job reads it (this epoch and the
    next; one worker per rank: the time within a rank's part), so the node keeps what its peers
    will ask for first."""
    if not owned:
        return times
    job = node_schedule(manifest, counts, dataclasses.replace(spec, num_workers=1, worker_id=0), range(spec.dp_size),
                        share_dir=share_dir)
    merged: dict[Any, list[float]] = {k: list(v) for k, v in times.times.items()}
    for key, ts in job.times.items():
        if key in owned:
            merged[key] = sorted(set(merged.get(key, [])) | set(ts))
    return Schedule(merged)


def peer_stats(cache_stats: dict[str, Any], membership: Membership | None) -> dict[str, Any]:
    """``stats()["peers"]``: the node's peer counters (node-wide, as the cache's) and the tier's state."""
    out: dict[str, Any] = {name: int(cache_stats.get(f"peer_{name}", 0)) for name in PEER_STATS}
    out["enabled"] = membership is not None
    out["node"] = -1 if membership is None else membership.me
    out["nodes"] = 0 if membership is None else len(membership.peers)
    return out
