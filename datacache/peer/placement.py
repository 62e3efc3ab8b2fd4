"""Which node of a job keeps which shard: rendezvous (highest random weight) hashing.

``rendezvous(names, addresses)`` ranks the nodes for every shard by a seeded 64-bit weight of
(shard name, node address) and returns, per shard, the node indices best first: entry 0 is the
shard's *owner*, which downloads it from the store for the whole job and keeps it. Weights depend
on the names and addresses only, never on the node count or order, so:

- every process of every node computes the same owners, with no communication;
- a node that joins takes about ``1 / N`` of the shards, all from the others, and a node that leaves
  hands its shards to the next node in each shard's ranking; no other shard moves;
- another job that knows this job's addresses computes the same owners.

``owners`` bounds the loads (a node owns at most ``(1 + SLACK) D / N`` bytes plus a shard), so
the bound holds on every node, not only on average. ``name_hashes`` gives the 64-bit ids of shard
names that the servers' held summaries use.
Pure functions over numpy arrays; thread-safe.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = ["name_hashes", "rendezvous", "owners", "fit", "SLACK"]

SLACK = 0.05  # a node owns at most (1 + SLACK) D / N bytes, plus one shard


def name_hashes(names: Sequence[str]) -> np.ndarray:
    """xxh3-64 of each shard name (uint64): the ids of the held summaries (``server``)."""
    return np.fromiter((xxhash.xxh3_64_intdigest(n.encode()) for n in names), dtype=np.uint64, count=len(names))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (uint64 in, uniform uint64 out)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def rendezvous(names: Sequence[str] | np.ndarray, addresses: Sequence[str]) -> np.ndarray:
    """(shards, nodes) int32: for every shard the node indices of ``addresses``, highest weight
    first. ``names``: shard names, or their ``name_hashes``."""
    ids = names if isinstance(names, np.ndarray) else name_hashes(names)
    if not len(addresses):
        return np.zeros((len(ids), 0), dtype=np.int32)
    nodes = np.array([xxhash.xxh3_64_intdigest(a.encode()) for a in addresses], dtype=np.uint64)
    weights = _mix(ids[:, None] ^ _mix(nodes)[None, :])
    return np.ascontiguousarray(np.argsort(weights, axis=1)[:, ::-1]).astype(np.int32)


def owners(names: Sequence[str] | np.ndarray, addresses: Sequence[str], sizes: Sequence[int] | None = None,
           slack: float = SLACK) -> np.ndarray:
    """The owner (index into ``addresses``) of every shard: its first node in ``rendezvous`` order,
    with bounded loads when ``sizes`` are given: shards taken in the order of their name ids, each
    goes to the first node of its ranking that still holds less than ``(1 + slack) D / N`` bytes, so
    no node owns more than that plus one shard (a node's owned bytes must fit its cache for the
    bound). A shard whose first node is full moves to its second: a node that joins or leaves still
    moves little more than its share."""
    if not len(addresses):
        return np.zeros(len(names), dtype=np.int32)
    ranks = rendezvous(names, addresses)
    if sizes is None:
        return ranks[:, 0].copy()
    ids = names if isinstance(names, np.ndarray) else name_hashes(names)
    sz = np.asarray(sizes, dtype=np.int64)
    cap = (1.0 + slack) * float(sz.sum()) / len(addresses)
    load = np.zeros(len(addresses), dtype=np.int64)
    out = np.empty(len(sz), dtype=np.int32)
    for i in np.argsort(ids, kind="stable").tolist():
        row = ranks[i]
        k = next((int(k) for k in row if load[k] < cap), int(row[0]))
        out[i] = k
        load[k] += sz[i]
    return out


def fit(owner: np.ndarray, sizes: Sequence[int], budgets: Sequence[int], ids: np.ndarray,
        addresses: Sequence[str]) -> np.ndarray:
    """``owner`` with every node's owned bytes fitted to its cache (``budgets``, bytes by node) where
    the job's caches hold them all: a node that owns more than its cache hands shards (highest name
    id first) to the first node of each shard's ranking with room for it, until it fits or no node
    has room. So the store serves at most max(0, D - sum of the caches) per epoch even when the
    nodes' caches differ (a node with a small cache, one with room to spare). Pure and
    deterministic: every node computes the same owners from the same budgets."""
    sz = np.asarray(sizes, dtype=np.int64)
    out = np.asarray(owner, dtype=np.int32).copy()
    spare = np.asarray(budgets, dtype=np.int64) - np.bincount(out, weights=sz, minlength=len(budgets)).astype(np.int64)
    for k in range(len(budgets)):
        if spare[k] >= 0:
            continue
        mine = np.flatnonzero(out == k)
        for i in mine[np.argsort(ids[mine], kind="stable")[::-1]].tolist():
            if spare[k] >= 0:
                break
            row = rendezvous(ids[i:i + 1], addresses)[0]
            j = next((int(j) for j in row if j != k and spare[j] >= sz[i]), None)
            if j is not None:
                out[i], spare[j], spare[k] = j, spare[j] - sz[i], spare[k] + sz[i]
    return out
