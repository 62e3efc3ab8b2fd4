"""The epoch order of a mixed dataset: several streams as one virtual shard list. Pure functions.

Stream ``i`` drawn ``n_i`` times per epoch (``streams.draw_counts``) from its ``N_i`` samples
becomes ``ceil(n_i / N_i)`` *copies* of its shards in the virtual shard list (stream 0's copies
first, then stream 1's...). A virtual shard is one real shard of one stream (same cache key for
every copy), so every virtual sample is read at most once per epoch and the plan's exactly-once
machinery (``plan``, ``resume``) works on virtual ids unchanged. Per epoch a stream takes its
``floor(k)`` whole copies and, of the last copy, ``n_i mod N_i`` samples: its shards in a seeded
permutation (new each epoch with ``sampling="balanced"``, the same every epoch with ``"fixed"``),
whole shards and then the first samples of one more, so a subset costs its own bytes and one partly used shard. So each
sample is read ``floor(k)`` or ``ceil(k)`` times (``k = n_i / N_i``) and the epoch holds exactly
``n_i`` of stream ``i``.

The order (``MixPlan.epoch_order``) handed to ``plan.build_plan`` as its pool:

- ``"random"``: every selected shard piece of every stream in one seeded permutation; the plan's
  rank/worker split and sliding-window shuffle then mix them as for one dataset;
- ``"stratified"``: laid out batch by batch on the plan's batch boundaries (``datacache.store.transfer``: ranks cut
  into whole batches), each batch holding stream ``i``'s share ``size * n_i / n`` rounded down or
  up (``_quotas``), the epoch's totals kept exact; the plan then keeps the order (no shuffle);
- ``"per_stream"``: the same boundaries, each batch from one stream, the stream of each drawn
  with a probability proportional to its samples left (a shuffle of the streams' batches).

A resume with another layout re-lays the remainder out for the new layout (``resume_order``).

On several nodes (``spec.num_nodes`` with ``placement="node"``) the composed order is node-sticky:
the positions each node's ranks read are filled from the shards that node owns for the run
(``datacache.mixing.plan``); the random batching leaves that to the plan (``plan.build_plan``'s
node-sticky pool).

Node-sticky composed batches: a mix's ``"stratified"`` / ``"per_stream"`` order on several nodes.
Pure functions; results are read-only or fresh arrays (thread-safe).

The composed order (``datacache.mixing.plan``) fixes the stream of every position of the epoch. The plan cuts
the order into ranks of ``per`` contiguous positions, packed per node (``R = dp_size / nodes``
ranks a node), so node ``k`` reads the positions ``[k R per, (k + 1) R per)``; with ``drop_last``
the positions from ``nodes R per`` on are dropped (the *tail*, handled here as one more node that
reads nothing). This module fills node ``k``'s positions of stream ``i`` with samples of stream
``i`` from shards that node ``k`` owns:

- every real shard of a stream has one owner node for the run: ``assign_nodes`` on that stream's
  shard sizes, with a seed of its own per stream, so each node holds about ``1 / nodes`` of every
  stream (to within one shard) and a node-count change moves only the joining or leaving node's
  share, as for one dataset (``datacache.plan.epoch.node_assign``); the copies of a repeated stream's shard are one
  cache entry on one node;
- a node holding more of stream ``i``'s epoch samples than it has positions of stream ``i``
  gives the surplus, from its shards of the highest per-run rank (a seeded permutation of the
  stream's shards), so a stream drawn whole gives the same samples every epoch and the receiving
  node finds them in its cache; nodes short of samples receive them in node order;
- per_stream batches are drawn node by node, each node's count of each stream fixed for the run
  (its positions' share, within one sample), so the transfers stay the same from epoch to epoch.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..plan.epoch import PlanSpec
from ..plan.node_assign import assign_nodes
from ..plan.node_share import digest, memo, readonly
from ..plan.pieces import Pieces

__all__ = ["MixPlan", "fill_nodes", "give_rank", "node_slots", "per_rank", "position_nodes", "stream_owner"]


class MixPlan:
    """The virtual shard list of a mix and its per-epoch orders (see the module docstring).
    Immutable; thread-safe."""

    def __init__(self, shard_counts: Sequence[Sequence[int]], draws: Sequence[int], *, batching: str,
                 sampling: str, seed: int, shuffle: bool) -> None:
        self.batching, self.sampling, self.seed, self.shuffle = batching, sampling, seed, shuffle
        self.draws = [int(d) for d in draws]
        self.shard_counts = [np.asarray(c, dtype=np.int64) for c in shard_counts]
        self.sizes = [int(c.sum()) for c in self.shard_counts]
        stream, real, first = [], [], []
        for i, c in enumerate(self.shard_counts):
            copies = -(-self.draws[i] // self.sizes[i])
            first.append(len(stream))
            stream += [i] * (copies * len(c))
            real += list(range(len(c))) * copies
        self.first = first
        self.stream_of = readonly(stream)  # stream of each virtual shard
        self.real_of = readonly(real)  # its shard number in that stream
        self.counts = readonly(np.concatenate([np.resize(c, len(c) * -(-d // n)) for c, d, n in
                                               zip(self.shard_counts, self.draws, self.sizes)]))
        self.offsets = readonly(np.concatenate([[0], np.cumsum(self.counts)]))
        self.epoch_size = sum(self.draws)
        self._key = (digest(self.counts), tuple(self.draws), batching, sampling, seed, shuffle)

    @property
    def layout_bound(self) -> bool:
        """Whether the order depends on the plan's layout (ranks, batch size): batches are composed."""
        return self.batching != "random"

    def stream_of_samples(self, ids: np.ndarray) -> np.ndarray:
        """The stream of each virtual sample id."""
        return self.stream_of[np.searchsorted(self.offsets, ids, side="right") - 1]

    # ------------------------------------------------------------------ per-stream selection
    def selection(self, i: int, epoch: int) -> Pieces:
        """Stream ``i``'s samples of ``epoch`` as virtual pieces, in the stream's own seeded order."""
        c, n, size = self.shard_counts[i], self.draws[i], self.sizes[i]
        k = len(c)
        full, part = divmod(n, size)
        pieces = [Pieces.whole(self.first[i] + j * k + np.arange(k), self.counts) for j in range(full)]
        if part:
            sub_epoch = epoch if self.sampling == "balanced" else 0
            perm = np.random.default_rng([self.seed, sub_epoch, 7, i]).permutation(k) if self.shuffle \
                else np.arange(k)
            ends = np.cumsum(c[perm])
            whole = int(np.searchsorted(ends, part, side="right"))
            base = self.first[i] + full * k
            shards = base + perm[:whole]
            pieces.append(Pieces(shards, np.zeros(whole, dtype=np.int64), c[perm[:whole]]))
            rest = part - (int(ends[whole - 1]) if whole else 0)
            if rest:
                pieces.append(Pieces(np.array([base + perm[whole]]), np.zeros(1, dtype=np.int64),
                                     np.array([rest])))
        out = Pieces.concat(pieces)
        if self.shuffle:
            out = out.take(np.random.default_rng([self.seed, epoch, 8, i]).permutation(len(out.shard)))
        return out

    # ------------------------------------------------------------------ orders
    def epoch_order(self, spec: PlanSpec) -> np.ndarray:
        """The epoch's order of virtual sample ids for the plan's layout ``spec`` (memoized)."""
        key = ("mix-epoch",) + self._key + (spec.epoch,) + (_layout_key(spec) if self.layout_bound else ())
        return memo(key, lambda: self._epoch_order(spec))

    def _epoch_order(self, spec: PlanSpec) -> np.ndarray:
        parts = [self.selection(i, spec.epoch) for i in range(len(self.draws))]
        if not self.layout_bound:
            every = Pieces.concat(parts)
            if self.shuffle:
                every = every.take(np.random.default_rng([self.seed, spec.epoch, 9]).permutation(len(every.shard)))
            return readonly(every.samples(self.offsets))
        return self._layout([p.samples(self.offsets) for p in parts], spec, [self.seed, spec.epoch, 10])

    def resume_order(self, remainder: np.ndarray, spec: PlanSpec) -> np.ndarray:
        """A resume's remainder (``plan.remainder_order``) re-laid out for the new layout ``spec``."""
        if not self.layout_bound:
            return remainder
        label = self.stream_of_samples(remainder)
        seqs = [remainder[label == i] for i in range(len(self.draws))]
        return self._layout(seqs, spec, [self.seed, spec.epoch, 11, len(remainder)])

    def _layout(self, seqs: list[np.ndarray], spec: PlanSpec, rng_key: list[int]) -> np.ndarray:
        nodes = spec.layout_nodes
        counts = np.array([len(s) for s in seqs], dtype=np.int64)
        n = int(counts.sum())
        sizes = _slots(n, spec)
        if self.batching == "stratified":
            q = _quotas(counts, sizes, n)
            label = np.repeat(np.tile(np.arange(len(seqs)), len(sizes)), q.ravel())
        elif nodes == 1:
            label = _per_stream_labels(counts, sizes, np.random.default_rng(rng_key))
        else:  # each node's stream counts fixed for the run, its batches drawn from them
            slots = node_slots(sizes, n, spec, nodes)
            shares = _quotas(counts, np.array([int(s.sum()) for s in slots] + [n - int(sizes.sum())]), n)
            label = np.concatenate([_per_stream_labels(shares[k], s, np.random.default_rng(rng_key + [k]))
                                    for k, s in enumerate(slots)] + [np.zeros(0, dtype=np.int64)])
        used = np.bincount(label, minlength=len(seqs))
        label = np.concatenate([label, np.repeat(np.arange(len(seqs)), counts - used)])  # drop_last's tail
        where = position_nodes(n, spec, nodes) if nodes > 1 else None
        order = np.empty(n, dtype=np.int64)
        for i, s in enumerate(seqs):
            at = np.flatnonzero(label == i)  # ascending positions: node by node
            order[at] = s if where is None else self._fill(i, s, nodes, np.bincount(where[at], minlength=nodes + 1))
        return readonly(order)

    def _fill(self, i: int, seq: np.ndarray, nodes: int, need: np.ndarray) -> np.ndarray:
        """Stream ``i``'s samples ``seq`` regrouped node by node (``datacache.mixing.plan.fill_nodes``)."""
        real = self.real_of[np.searchsorted(self.offsets, seq, side="right") - 1]
        owner = stream_owner(self.shard_counts[i], nodes, self.seed, i)
        return fill_nodes(seq, owner[real], give_rank(len(self.shard_counts[i]), self.seed, i)[real], need)

    def batch_cuts(self, samples: np.ndarray, size: int, after: int = 0) -> list[int]:
        """Where a worker's batches end in per_stream mode, from position ``after`` (a batch
        boundary) on: at the plan's batch boundaries (multiples of ``size``: a worker starts on
        one), and where the stream changes (the few plan batches that hold two streams split in
        two). So ``len()`` is the same for any number of workers."""
        label = self.stream_of_samples(samples)
        change = (np.flatnonzero(np.diff(label)) + 1).tolist() + [len(samples)]
        cuts, pos, ci = [], int(after), 0
        while pos < len(samples):
            while change[ci] <= pos:
                ci += 1
            pos = min((pos // size + 1) * size, change[ci])
            cuts.append(pos)
        return cuts


def _layout_key(spec: PlanSpec) -> tuple[int, int, bool, int]:
    return spec.dp_size, spec.batch_size, spec.drop_last, spec.layout_nodes


def _slots(n: int, spec: PlanSpec) -> np.ndarray:
    """Sizes of the plan's consecutive batches over the positions ``[0, used)`` of an order of
    ``n`` (``plan``: ranks get ``per`` positions each, cut into batches from each rank's start;
    ``drop_last`` drops the positions after ``used``)."""
    b, dp = spec.batch_size, spec.dp_size
    per, used = per_rank(n, spec)
    if used == 0:
        return np.zeros(0, dtype=np.int64)
    starts = (np.arange(dp)[:, None] * per + np.arange(0, per, b)[None, :]).ravel()
    starts = starts[starts < used]
    return np.diff(np.append(starts, used))


def _quotas(counts: np.ndarray, sizes: np.ndarray, n: int) -> np.ndarray:
    """Samples of each stream (columns) in each batch (rows): ``size * counts / n`` rounded down,
    plus one for the streams furthest behind their share of the positions so far, so every entry
    is within one sample of its share and the columns sum to ``counts`` (fixed up if not)."""
    q = np.empty((len(sizes), len(counts)), dtype=np.int64)
    given = np.zeros(len(counts), dtype=np.int64)
    end = 0
    for t, size in enumerate(sizes.tolist()):
        end += size
        base = size * counts // n
        r = size - int(base.sum())
        if r:
            behind = end * counts - n * (given + base)
            base[np.argsort(-behind, kind="stable")[:r]] += 1
        q[t] = base
        given += base
    if end == n:
        _fix_totals(q, counts, sizes, n)
    return q


def _fix_totals(q: np.ndarray, counts: np.ndarray, sizes: np.ndarray, n: int) -> None:
    """Move single extra samples between streams, within batches where one stream holds one
    above its floor and the other none, until every column sums to its count."""
    floor = sizes[:, None] * counts[None, :] // n
    diff = q.sum(axis=0) - counts
    while diff.any():
        over, under = int(np.argmax(diff)), int(np.argmin(diff))
        rows = np.flatnonzero((q[:, over] > floor[:, over]) & (q[:, under] == floor[:, under]))
        if not len(rows):
            raise AssertionError(f"stratified quotas cannot be balanced: {diff.tolist()}")
        q[rows[0], over] -= 1
        q[rows[0], under] += 1
        diff[over] -= 1
        diff[under] += 1


def _per_stream_labels(counts: np.ndarray, sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The stream of each position in per_stream mode: each batch from one stream, drawn with a
    probability proportional to its samples left; a stream that runs out mid-batch is followed
    by another (that batch splits in two)."""
    left = counts.astype(np.float64)
    streams, takes = [], []
    for size in sizes.tolist():
        while size:
            i = int(rng.choice(len(left), p=left / left.sum()))
            take = int(min(size, left[i]))
            streams.append(i)
            takes.append(take)
            left[i] -= take
            size -= take
    return np.repeat(np.array(streams, dtype=np.int64), np.array(takes, dtype=np.int64))


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
    """The plan's batch sizes (``datacache.mixing.plan._slots``) cut per node (batches never cross ranks)."""
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
