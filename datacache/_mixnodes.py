"""Node-sticky composed batches: a mix's ``"stratified"`` / ``"per_stream"`` order on several nodes.
Pure functions; results are read-only or fresh arrays (thread-safe).

The composed order (``_mixplan``) fixes the stream of every position of the epoch. The plan cuts
the order into ranks of ``per`` contiguous positions, packed per node (``R = dp_size / nodes``
ranks a node), so node ``k`` reads the positions ``[k R per, (k + 1) R per)``; with ``drop_last``
the positions from ``nodes R per`` on are dropped (the *tail*, handled here as one more node that
reads nothing). This module fills node ``k``'s positions of stream ``i`` with samples of stream
``i`` from shards that node ``k`` owns:

- every real shard of a stream has one owner node for the run: ``assign_nodes`` on that stream's
  shard sizes, with a seed of its own per stream, so each node holds about ``1 / nodes`` of every
  stream (to within one shard) and a node-count change moves only the joining or leaving node's
  share, as for one dataset (``_nodeorder``); the copies of a repeated stream's shard are one
  cache entry on one node;
- a node holding more of stream ``i``'s epoch samples than it has positions of stream ``i``
  gives the surplus, from its shards of the highest per-run rank (a seeded permutation of the
  stream's shards), so a stream drawn whole gives the same samples every epoch and the receiving
  node finds them in its cache; nodes short of samples receive them in node order;
- per_stream batches are drawn node by node, each node's count of each stream fixed for the run
  (its positions' share, within one sample), so the transfers stay the same from epoch to epoch.
"""
from __future__ import annotations

import numpy as np

from ._nodeorder import assign_nodes, memo, readonly
from .plan import PlanSpec

__all__ = ["per_rank", "position_nodes", "stream_owner", "give_rank", "fill_nodes", "node_slots"]


def per_rank(n: int, spec: PlanSpec) -> tuple[int, int]:
    """(positions per rank, positions used) of an order of ``n`` (as ``plan`` cuts it)."""
    if spec.drop_last:
        per = n // spec.dp_size // spec.batch_size * spec.batch_size
        return per, per * spec.dp_size
    return -(-n // spec.dp_size), n


def position_nodes(n: int, spec: PlanSpec, nodes: int) -> np.ndarray:
    """The node that reads each position of an order of ``n`` (``nodes`` for the dropped tail;
    ``PlanSpec`` has checked that ``nodes`` divides the ranks)."""
    per, used = per_rank(n, spec)
    where = np.full(n, nodes, dtype=np.int64)
    if per:
        where[:used] = np.arange(used, dtype=np.int64) // per // (spec.dp_size // nodes)
    return where


def node_slots(sizes: np.ndarray, n: int, spec: PlanSpec, nodes: int) -> list[np.ndarray]:
    """The plan's batch sizes (``_mixplan._slots``) cut per node (batches never cross ranks)."""
    per, _ = per_rank(n, spec)
    span = per * (spec.dp_size // nodes)
    ends = np.cumsum(sizes)
    cut = np.searchsorted(ends, np.arange(1, nodes) * span, side="right")
    return np.split(sizes, cut)


def stream_owner(sizes: np.ndarray, nodes: int, seed: int, stream: int) -> np.ndarray:
    """Owner node of each real shard of stream ``stream`` (``sizes``: its samples per shard), for
    the run."""
    return assign_nodes(sizes, nodes, _stream_seed(seed, stream))


def give_rank(shards: int, seed: int, stream: int) -> np.ndarray:
    """Per-run rank of each real shard of a stream: a node gives its samples of the highest ranks."""
    return memo(("mix-give", shards, seed, stream), lambda: readonly(
        np.random.default_rng([seed, 12, stream]).permutation(shards)))


def _stream_seed(seed: int, stream: int) -> int:
    return (int(seed) * 1_000_003 + 7_919 * (stream + 1)) % (1 << 62)


def fill_nodes(seq: np.ndarray, owner: np.ndarray, rank: np.ndarray, need: np.ndarray) -> np.ndarray:
    """``seq`` (a stream's samples in its epoch order; ``owner``/``rank``: its samples' owner node
    and shard rank) regrouped into the nodes' parts, node 0's first, part ``k`` of ``need[k]``
    samples (the last entry: the tail): each node keeps its own samples in their order, less the
    surplus it gives (of its highest-ranked shards), and then receives what it lacks."""
    nodes = len(need) - 1
    if int(need.sum()) != len(seq):
        raise AssertionError(f"node needs {int(need.sum())} != {len(seq)} samples")
    by = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[by], np.arange(nodes + 2))
    kept: list[np.ndarray] = []
    given: list[np.ndarray] = []
    for k in range(nodes + 1):
        own = by[bounds[k]:bounds[k + 1]]
        extra = len(own) - int(need[k])
        if extra > 0:
            out = np.zeros(len(own), dtype=bool)
            out[np.argsort(rank[own], kind="stable")[len(own) - extra:]] = True
            given.append(own[out])
            own = own[~out]
        kept.append(own)
    pool = np.concatenate(given) if given else np.zeros(0, dtype=np.int64)
    parts, at = [], 0
    for k in range(nodes + 1):
        lack = int(need[k]) - len(kept[k])
        parts += [kept[k], pool[at:at + lack]]
        at += lack
    return seq[np.concatenate(parts)]
