"""The node-sticky part of the epoch plan: which node reads which shard, for the whole run.

``assign_nodes`` gives each shard an owner node, once per run: a pure function of the shard sizes,
the node count and the seed (never of the epoch). It is built node by node: with ``k`` nodes
assigned, node ``k`` joins by taking from every node ``j < k`` the shards with the highest seeded
hash ``h(seed, shard, k)`` until ``j`` is down to ``D / (k + 1)`` bytes, rounding so that the
newcomer's running total tracks its exact target. Hence:

- balance: every node holds ``D / N`` bytes to within one shard's size (guaranteed while each join
  takes at least one shard from every node: ``D / (N (N + 1))`` at least the largest shard; about
  one shard beyond that);
- stickiness: the assignment for ``N + 1`` nodes is the one for ``N`` with node ``N`` taking its
  share from the others, so going from ``N`` to ``N + 1`` nodes (or back) moves only the last
  node's share (``D / (N + 1)`` to within one shard), and every other node keeps all the shards it
  still owns: after ``N + 1 -> N`` a node keeps every shard it held; after ``N -> N + 1`` every
  shard it now owns is one it held. Node ranks must stay with their hosts (a removed node is the
  last one) for caches to stay useful.

``node_pieces`` is the epoch order under that assignment: each node's samples (its shards, and the
few samples that move between nodes so that every node has exactly its ranks' share; those are
chosen once per run too, from a node's largest shard, see ``_transfers``), its shards permuted
per epoch and its samples contiguous per shard, padded by repeating its own first samples (``drop_last=False``) or
cut (``drop_last=True``), nodes one after the other. Pure; results are memoized per process
(thread-safe) and read-only.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .node_share import digest, memo, readonly, shared_array
from .pieces import Pieces

__all__ = ["assign_nodes", "node_pieces", "node_part"]

_CHUNK = 1 << 16
_assignments: OrderedDict[tuple[Any, ...], Any] = OrderedDict()


def _hash(seed: int, ids: np.ndarray, node: int) -> np.ndarray:
    """splitmix64 of (seed, shard id, node): uniform 64-bit weights, stable across versions."""
    with np.errstate(over="ignore"):
        x = ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x ^= np.uint64((int(seed) * 0xBF58476D1CE4E5B9 + int(node) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF)
        for shift, mul in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            x ^= x >> np.uint64(shift)
            x *= np.uint64(mul)
        x ^= x >> np.uint64(31)
    return x  # uint64 arithmetic wraps: already modulo 2**64


def assign_nodes(sizes: np.ndarray, num_nodes: int, seed: int, share_dir: str | None = None) -> np.ndarray:
    """Owner node of every shard (see the module docstring), read-only, of the smallest integer
    type that holds the node ids; ``sizes``: bytes (or samples) per shard. Memoized per process
    (kept apart from the epochs' entries); ``share_dir`` (the node cache's control directory): computed
    once per node and mapped by the node's other processes (``datacache.plan.node_share``)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    num_nodes, seed = int(num_nodes), int(seed)
    ident = digest(sizes)
    dtype = _owner_dtype(num_nodes)

    def valid(a: np.ndarray) -> bool:
        return a.shape == sizes.shape and a.dtype == dtype and (not len(a) or 0 <= a.min() <= a.max() < num_nodes)

    def make() -> np.ndarray:
        name = f"assign-v1-{str(ident).replace(':', '-')}-{num_nodes}-{seed}"
        return readonly(shared_array(share_dir, name, lambda: _assign(sizes, num_nodes, seed), valid), dtype)
    return memo(("assign", ident, num_nodes, seed), make, store=_assignments)


def _owner_dtype(num_nodes: int) -> np.dtype:
    return np.dtype(np.int16 if num_nodes <= np.iinfo(np.int16).max else np.int32)


def _assign(sizes: np.ndarray, num_nodes: int, seed: int) -> np.ndarray:
    n = len(sizes)
    owner = np.zeros(n, dtype=_owner_dtype(num_nodes))
    load = np.zeros(num_nodes, dtype=np.float64)
    load[0] = float(sizes.sum())
    total = load[0]
    ids = np.arange(n, dtype=np.int64)
    smallest = float(sizes.min()) if n else 0.0
    for k in range(1, num_nodes):
        target = total / (k + 1)
        w = _hash(seed, ids, k)
        # Only the highest weights can be taken (each node gives about 1/(k+1) of its shards):
        # look at those first, and at a donor's whole list only if they do not suffice.
        frac = min(1.0, 2.0 / (k + 1))  # twice what a donor gives; the fallback below covers the rest
        cand = ids if frac >= 1.0 else np.flatnonzero(w >= np.uint64(int((1.0 - frac) * 2.0**64)))
        cand = cand[np.lexsort((~w[cand], owner[cand]))]
        bounds = np.searchsorted(owner[cand], np.arange(k + 1))
        got, want = 0.0, 0.0
        for j in range(k):
            want += load[j] - target
            mine = cand[bounds[j]:bounds[j + 1]]
            give = _take(mine, sizes, got, want)
            if give == len(mine) and want - got - sizes[mine].sum() >= smallest / 2:  # might give more
                mine = np.flatnonzero(owner == j)
                mine = mine[np.argsort(~w[mine], kind="stable")]
                give = _take(mine, sizes, got, want)
            taken = mine[:give]
            moved = float(sizes[taken].sum())
            owner[taken] = k
            load[j] -= moved
            load[k] += moved
            got += moved
    return owner


def _take(mine: np.ndarray, sizes: np.ndarray, got: float, want: float) -> int:
    """How many of ``mine`` (in order) to give so the taker's total rounds to ``want``: shard ``i``
    goes when the total before it plus half its size is at most ``want``."""
    s = sizes[mine].astype(np.float64)
    mid = got + np.cumsum(s) - s / 2
    return int(np.searchsorted(mid, want, side="right"))


def _node_shards(counts: np.ndarray, owner: np.ndarray, node: int) -> Pieces:
    """Node ``node``'s shards as whole pieces, its largest last (ties by id): what it gives to
    other nodes comes from one shard. O(shards) time, O(share) memory."""
    ids = np.flatnonzero(owner == node)
    return Pieces.whole(ids[np.argsort(counts[ids], kind="stable")], counts)


@dataclass(frozen=True)
class _Layout:
    """How the epoch's samples are spread over the nodes (fixed for the run, whatever the epoch):
    each node's ``quota`` (its ranks' share), the ``moves`` (giver, receiver, samples) that
    balance them, and the padded count."""

    have: np.ndarray
    quota: int
    moves: list[tuple[int, int, int]]
    out_of: np.ndarray
    padded: int


def _layout(have: np.ndarray, num_nodes: int, dp_size: int, drop_last: bool, unit: int) -> _Layout:
    total = int(have.sum())
    per = total // dp_size // unit * unit if drop_last else -(-total // dp_size)
    quota = per * (dp_size // num_nodes)
    surplus, deficit = np.maximum(have - quota, 0), np.maximum(quota - have, 0)
    moving = min(int(surplus.sum()), int(deficit.sum()))
    # What moves (fixed for the run): each transfer is a giver's last samples of its own shards.
    moves = _transfers(_fill(surplus, moving), _fill(deficit, moving), have)
    out_of = np.zeros(num_nodes, dtype=np.int64)
    into = np.zeros(num_nodes, dtype=np.int64)
    for src, dst, amount in moves:
        out_of[src] += amount
        into[dst] += amount
    padded = int(np.maximum(quota - (have - out_of + into), 0).sum())
    return _Layout(have, quota, moves, out_of, padded)


def _node_part(k: int, of_node: Callable[[int], Pieces], lay: _Layout, base: Callable[[], Pieces], *,
               shuffle: bool, seed: int, epoch: int) -> Pieces:
    """Node ``k``'s part of the epoch order (``quota`` samples): its own samples less what it
    gives, plus what it receives, its shards permuted, then padded from its start or cut."""
    at = lay.have - lay.out_of
    got = []
    for src, dst, amount in lay.moves:
        if dst == k:
            got.append(of_node(src).cut(at[src], at[src] + amount))
        at[src] += amount
    mine = Pieces.concat([of_node(k).cut(0, lay.have[k] - lay.out_of[k])] + got)
    mine = _shuffle_shards(mine, shuffle, seed, epoch, k)
    if len(mine) >= lay.quota:
        return mine.cut(0, lay.quota)  # drop_last: this epoch's last samples of the node
    src = mine if len(mine) else base()
    return Pieces.concat([mine, src.resize(lay.quota - len(mine))])


def _per_node(owner: np.ndarray, counts: np.ndarray, num_nodes: int) -> np.ndarray:
    """Samples per node, exact in int64, in chunks: no full-length copy (``bincount`` would make
    float weights and full-length indices of the node ids)."""
    have = np.zeros(num_nodes, dtype=np.int64)
    for a in range(0, len(owner), _CHUNK):
        np.add.at(have, owner[a:a + _CHUNK], counts[a:a + _CHUNK])
    return have


def node_part(counts: np.ndarray, *, weights: np.ndarray, node: int, num_nodes: int, dp_size: int,
              drop_last: bool, unit: int, shuffle: bool, seed: int, epoch: int) -> tuple[Pieces, int]:
    """(node ``node``'s part of the epoch order (``node_pieces`` cut to that node, ``quota``
    samples), the padded count of the whole epoch). O(shards) time; memory O(shards / nodes)
    besides the assignment."""
    owner = assign_nodes(weights, num_nodes, seed)
    lay = memo(("layout", digest(counts), digest(weights), num_nodes, seed, dp_size, drop_last, unit),
               lambda: _layout(_per_node(owner, counts, num_nodes), num_nodes, dp_size, drop_last, unit))
    shards = functools.lru_cache(maxsize=None)(lambda j: _node_shards(counts, owner, j))
    every = lambda: Pieces.concat([shards(j) for j in range(num_nodes)])  # noqa: E731
    part = _node_part(node, shards, lay, every, shuffle=shuffle, seed=seed, epoch=epoch)
    return part, lay.padded


def node_pieces(counts: np.ndarray, offsets: np.ndarray, *, weights: np.ndarray, pool: np.ndarray | None,
                num_nodes: int, dp_size: int, drop_last: bool, unit: int, shuffle: bool, seed: int,
                epoch: int) -> tuple[Pieces, int]:
    """(the epoch's order, of length ``per_rank * dp_size``, padded repeats): see the module
    docstring. ``pool``: the samples to plan (default every sample; a resume's remainder);
    ``drop_last`` leaves each rank a multiple of ``unit`` samples. O(shards) for a whole epoch."""
    owner = assign_nodes(weights, num_nodes, seed)
    if pool is None:  # per node, its largest shards last: what a node gives comes from one shard
        base = Pieces.concat([_node_shards(counts, owner, j) for j in range(num_nodes)])
    else:
        base = Pieces.from_samples(np.sort(np.asarray(pool, dtype=np.int64)), offsets)
        base = base.take(np.argsort(owner[base.shard], kind="stable"))
    bounds = np.searchsorted(owner[base.shard], np.arange(num_nodes + 1))
    of_node = [Pieces(base.shard[a:b], base.lo[a:b], base.hi[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    lay = _layout(np.array([len(p) for p in of_node], dtype=np.int64), num_nodes, dp_size, drop_last, unit)
    parts = [_node_part(k, of_node.__getitem__, lay, lambda: base, shuffle=shuffle, seed=seed, epoch=epoch)
             for k in range(num_nodes)]
    return Pieces.concat(parts), lay.padded


def _transfers(gives: np.ndarray, takes: np.ndarray, have: np.ndarray) -> list[tuple[int, int, int]]:
    """(giver, receiver, samples) moves that take ``gives[k]`` from each node and bring
    ``takes[k]`` to each. Givers are matched to receivers in node order; the givers of one receiver
    are then chained (the first gives its part to the second, which passes that much of its own
    plus its part to the next, ..., the last to the receiver), so a node reads the shards of one
    or two other nodes, not of every giver. Plain pairs where a node has too few samples to pass."""
    pairs: list[tuple[int, int, int]] = []
    g, r = [[k, int(v)] for k, v in enumerate(gives) if v], [[k, int(v)] for k, v in enumerate(takes) if v]
    i = j = 0
    while i < len(g) and j < len(r):
        amount = min(g[i][1], r[j][1])
        pairs.append((g[i][0], r[j][0], amount))
        g[i][1] -= amount
        r[j][1] -= amount
        i, j = i + (g[i][1] == 0), j + (r[j][1] == 0)
    chained: list[tuple[int, int, int]] = []
    for dst in dict.fromkeys(p[1] for p in pairs):
        group = [p for p in pairs if p[1] == dst]
        passed = 0
        for (src, _, amount), nxt in zip(group, group[1:] + [(dst, dst, 0)]):
            passed += amount
            chained.append((src, nxt[0], passed))
    out = np.zeros(len(have), dtype=np.int64)
    for src, _, amount in chained:
        out[src] += amount
    return chained if np.all(out <= have) else pairs


def _fill(cap: np.ndarray, amount: int) -> np.ndarray:
    """``amount`` spread over ``cap`` greedily, first entries first."""
    before = np.concatenate([[0], np.cumsum(cap)[:-1]])
    return np.clip(amount - before, 0, cap)


def _shuffle_shards(mine: Pieces, shuffle: bool, seed: int, epoch: int, node: int) -> Pieces:
    """``mine`` (ascending within each shard) with its shards in a seeded per-(epoch, node) order."""
    if not shuffle or len(mine.shard) == 0:
        return mine
    shards = np.unique(mine.shard)
    perm = np.random.default_rng([seed, epoch, 0, node, 1]).permutation(len(shards))
    rank = np.empty(len(shards), dtype=np.int64)
    rank[perm] = np.arange(len(shards))
    return mine.take(np.argsort(rank[np.searchsorted(shards, mine.shard)], kind="stable"))
