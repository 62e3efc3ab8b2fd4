"""The epoch plan: which samples each consumer reads, in which order. A pure function.

A plan depends only on (shard sample counts, seed, epoch, shuffle, window, the node mix's fields,
drop_last, data-parallel size and rank, number of workers, worker id, batch size, and with several
nodes the node count and shard sizes), so every process can compute every other process's plan:
that is how a consumer knows its future reads exactly, and how the node's cache learns the next
use of every shard for clairvoyant eviction. Steps:

1. Global order: the shards in a seeded permutation (per seed and epoch), each shard's samples
   contiguous. Every rank computes the same order.
   With several nodes (``num_nodes > 1``, ``placement="node"``, the default) the order is instead
   node-sticky (``datacache.plan.node_assign``): every shard belongs to one node for the whole run
   (seeded, balanced in bytes, barely moved when the node count changes), and each epoch permutes
   only within a node's share; nodes follow one another in the order, each with exactly its
   ranks' share (padded or cut per node). ``placement="global"`` keeps the global permutation.
2. Ranks: the order is cut into ``dp_size`` equal contiguous parts (ranks are packed per node; a
   node-sticky plan builds only the rank's node's part, ``datacache.plan.epoch.node_assign.node_part``).
   ``drop_last=False`` pads the order by repeating samples from its start until it divides evenly
   (``padded`` counts them); ``drop_last=True`` drops the remainder. Every rank therefore reads
   the same number of samples, and, since the worker split below is the same everywhere, yields
   the same number of batches.
   In batched mode (``batch_size`` > 1) ``drop_last=True`` also drops a rank's last partial batch
   (the remainder of the order modulo ``dp_size * batch_size``): every batch is full.
3. Workers: a rank's part is cut into batches of ``batch_size`` (1 in samples mode) and the
   batches into ``num_workers`` contiguous parts (batch counts differ by at most 1), so that each
   worker reads shards of its own. Unshuffled (``in_turns``), the batches are dealt in turn
   instead: worker ``w`` gets batches ``w``, ``w + num_workers``, ... of the rank (in samples
   mode, turns of as many samples as a torch DataLoader batches from one worker), which is the
   order torch's DataLoader takes them in, so the training loop gets the written order. Only the
   rank's last batch may be short (the last of the worker that holds it): the rank yields
   ``ceil(samples / batch_size)`` batches whatever ``num_workers`` is, which is what the
   dataset's ``len()`` says.
4. Sliding-window shuffle: a worker's samples form *runs* (consecutive samples of one shard). Each
   sample of run ``r`` gets the key ``r + U[0, 1) * min(window, (R - r + 1) / 2)`` (``R`` runs)
   and samples are read in key order, so a sample may move anywhere across ``window`` consecutive
   runs (fewer for the last ``2 * window`` runs: the last step then holds 1.33 runs, not 2.5, and
   a link-bound epoch ends soon after its last shard arrives). Reading is a pipeline of *steps*:
   step ``i`` reads the keys in ``[i, i + 1)``, which come only from runs ``i - window + 1 .. i``,
   so run ``i`` must be local when step ``i`` begins and can be released after step
   ``i + window - 1``. The consumer starts after its first shard (not after a whole window) and
   holds at most ``window`` shards; a larger window mixes more but keeps more shards open.
   The default of 4 mixes each batch across about 4 shards. Shuffled, the largest of a worker's
   last ``window`` runs is moved to its end: after a small last run (the dataset's short last
   shard, a piece of a shard another worker reads) the run before it would arrive just before
   the end too, and both of their steps would be left to read once the last byte is in.
5. Node mix (``datacache.plan.node_shuffle``, replacing steps 3's order and 4): from epoch
   ``mix_from`` on, a node whose part's shards fit in ``mix_bytes`` permutes its whole part
   uniformly before the rank and worker split, and its consumers read in chunks grouped by shard.
   Before ``mix_from``, with ``part_bytes`` set, such a node reads a part mix instead
   (``datacache.plan.part_shuffle``): its part cut into parts of shards, the parts permuted, the samples
   shuffled over a sliding window of parts in node time and dealt to the consumers' batches in
   the order the loaders take them, each part read by ranged reads.

Exactly once: across all ranks and workers of an epoch every sample appears once, plus ``padded``
repeats when ``drop_last=False``. Resuming a partly consumed epoch with another world size uses
``remainder_order`` to get the not-yet-read samples (grouped by shard, in the epoch's shard order)
and plans them the same way.

``ConsumerPlan``: one consumer's reads for one epoch, as ``datacache.plan.epoch.build_plan`` returns
them, and ``piece_runs``, which cuts a read order into runs of one shard each. Pure data and a pure
function; a plan is immutable once built (thread-safe to share).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np

from .node_assign import node_part, node_pieces
from .node_share import digest, memo
from .node_shuffle import DEFAULT_CHUNK_BYTES, MIX_GROWTH, chunk_runs, chunk_samples, mix_positions, node_mixes
from .part_shuffle import PART_WINDOW, part_chunk, part_mixes, part_piece, part_rows
from .pieces import Pieces

__all__ = ["ConsumerPlan", "DEFAULT_WINDOW", "EpochOrders", "PlanSpec", "build_plan", "first_shards", "global_order",
           "mixed_share", "piece_runs", "remainder_order", "split_even"]

DEFAULT_WINDOW = 4


@dataclass(frozen=True, kw_only=True)
class PlanSpec:
    """Everything a plan depends on besides the shard sizes. Immutable. ``composed``: the order
    given to ``build_plan`` is final (a mix's composed batches, ``datacache.mixing.plan``, which
    lays itself out over ``layout_nodes``): the ranks cut it as it is. ``mix_bytes``,
    ``mix_from``: from epoch ``mix_from`` on, a node whose part's shards hold at most
    ``mix_bytes`` bytes (sample counts without ``shard_bytes``) reads it as one uniform
    permutation (``datacache.plan.node_shuffle``; 0: never); ``chunk_bytes``: a mixed consumer's read
    granule, which changes no sample's position; ``in_place``: the node's rows are read in place
    (every block raw), so a chunk costs one run per shard whatever its size, and holds no memory:
    a node mix then reads in as few chunks as that (``datacache.plan.node_shuffle.chunk_bounds``).
    ``part_bytes``: where > 0, an earlier epoch whose part would be mixed so is read as a part mix instead
    (``datacache.plan.part_shuffle``), in parts of about that many bytes, cut along units of ``unit_rows``
    samples where > 0 (the writer's samples per dcz block: ``Manifest.extra["unit_rows"]``), so that a part is
    one ranged read.
    ``part_narrow``: the epoch's last parts over which that part mix's window narrows, where a
    part holds 64 samples or more (``datacache.plan.part_shuffle``; 0: it does not, as in states saved
    before it). ``part_strata``: where > 0, that part mix reads its parts in rounds over as many
    spans of the dataset by write position, not in a uniform permutation (0: as in states saved
    before it). ``in_turns``: ``k`` > 0 deals a rank's batches to its workers in turns of ``k``
    batches, 0 in contiguous shares (step 3; an unshuffled ``StreamingDataset`` plans with 1, or in
    samples mode with the batch size of the torch DataLoader that batches its samples; states
    saved before it with 0)."""

    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    window: int = DEFAULT_WINDOW
    drop_last: bool = False
    dp_size: int = 1
    dp_rank: int = 0
    num_workers: int = 1
    worker_id: int = 0
    batch_size: int = 1
    num_nodes: int = 1
    placement: str = "node"
    composed: bool = False
    mix_bytes: int = 0
    mix_from: int = 1
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    in_place: bool = False
    part_bytes: int = 0
    part_narrow: int = 0
    part_strata: int = 0
    unit_rows: int = 0
    in_turns: int = 0
    shard_bytes: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def layout_nodes(self) -> int:
        """The nodes the ranks are laid over: ``num_nodes`` with ``placement="node"``, else 1."""
        return self.num_nodes if self.placement == "node" else 1

    @property
    def node_placed(self) -> bool:
        """Whether this plan keeps shards on their nodes for the run (``placement="node"``, several
        nodes), rather than a ``composed`` order that does so itself."""
        return self.layout_nodes > 1 and not self.composed

    @property
    def node(self) -> int:
        """The node of ``dp_rank`` (ranks are packed per node, ``dp_size / num_nodes`` each)."""
        return self.dp_rank // (self.dp_size // self.layout_nodes)

    def __post_init__(self) -> None:
        if self.placement not in ("node", "global"):
            raise ValueError(f"placement={self.placement!r}: expected 'node' or 'global'")
        if self.num_nodes < 1 or self.dp_size % self.layout_nodes:
            raise ValueError(f"num_nodes={self.num_nodes} must be >= 1 and divide dp_size={self.dp_size} "
                             "(each node runs the same number of data-parallel ranks); or use placement='global'")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} not in [0, {self.dp_size})")
        if not 0 <= self.worker_id < max(self.num_workers, 1):
            raise ValueError(f"worker_id {self.worker_id} not in [0, {self.num_workers})")
        if self.window < 1:
            raise ValueError("window must be >= 1 shard")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")


class EpochOrders(Protocol):
    """An epoch order other than step 1's (a mixed dataset's, ``datacache.mixing.plan.MixPlan``)."""

    def epoch_order(self, spec: PlanSpec) -> np.ndarray:
        """The order of ``spec.epoch`` for the layout of ``spec`` (passed as ``build_plan``'s order)."""
        ...

    def resume_order(self, remainder: np.ndarray, spec: PlanSpec) -> np.ndarray:
        """A resume's ``remainder_order`` laid out for the layout of ``spec``."""
        ...


def _offsets(counts: np.ndarray) -> np.ndarray:
    """Each shard's first sample id, plus the total (memoized; read-only)."""
    def make() -> np.ndarray:
        out = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, dtype=np.int64, out=out[1:])  # in place: one full-length array at peak
        out.flags.writeable = False
        return out
    return memo(("offsets", digest(np.asarray(counts, dtype=np.int64))), make)


def global_order(counts: np.ndarray, spec: PlanSpec) -> np.ndarray:
    """Global sample ids of one epoch, shard-contiguous, shards permuted when shuffling (placement
    "global", or one node)."""
    counts = np.asarray(counts, dtype=np.int64)
    return _global_pieces(counts, spec).samples(_offsets(counts))


def _global_pieces(counts: np.ndarray, spec: PlanSpec) -> Pieces:
    shards = np.arange(len(counts))
    if spec.shuffle:
        shards = np.random.default_rng([spec.seed, spec.epoch, 0]).permutation(len(counts))
    return Pieces.whole(shards, counts)


def _epoch_key(counts: np.ndarray, weights: np.ndarray, spec: PlanSpec, pool: np.ndarray | None) -> tuple:
    unit = spec.batch_size if spec.drop_last else 1
    return (digest(counts), digest(weights) if spec.node_placed else None, digest(pool), spec.seed, spec.epoch,
            spec.shuffle, spec.drop_last, unit, spec.dp_size, spec.num_nodes if spec.node_placed else 1,
            spec.layout_nodes if spec.composed else 0)  # a composed order pads from its last node's part


def _weights(counts: np.ndarray, spec: PlanSpec) -> np.ndarray:
    return counts if spec.shard_bytes is None else np.asarray(spec.shard_bytes, dtype=np.int64)


def epoch_pieces(counts: np.ndarray, spec: PlanSpec, pool: np.ndarray | None = None) -> tuple[Pieces, int]:
    """The epoch's whole read order before the rank split, of length ``per_rank * dp_size``
    (padded or cut), and the padded count; ``pool``: the samples to plan instead of all of them
    (a resume's remainder, in its order for a global plan). Memoized per process; O(shards) for a
    whole epoch. Node-sticky with ``spec.node_placed`` (``datacache.plan.node_assign``)."""
    counts = np.asarray(counts, dtype=np.int64)
    weights = _weights(counts, spec)
    unit = spec.batch_size if spec.drop_last else 1
    offsets = _offsets(counts)

    def make() -> tuple[Pieces, int]:
        if spec.node_placed:
            return node_pieces(counts, offsets, weights=weights, pool=pool, num_nodes=spec.num_nodes,
                               dp_size=spec.dp_size, drop_last=spec.drop_last, unit=unit,
                               shuffle=spec.shuffle, seed=spec.seed, epoch=spec.epoch)
        base = _global_pieces(counts, spec) if pool is None else Pieces.from_samples(pool, offsets)
        n, parts = len(base), spec.dp_size
        if spec.drop_last:
            return base.cut(0, n // parts // unit * unit * parts), 0
        padded = (-(-n // parts) * parts - n) if n else 0
        # A node-sticky composed order pads the last rank from its own node's part.
        src = base.cut(-(-n // parts) * (parts - parts // spec.layout_nodes), n) if spec.composed else base
        return Pieces.concat([base, (src if len(src) else base).resize(padded)]), padded
    return memo(("epoch",) + _epoch_key(counts, weights, spec, pool), make)


def _rank_segment(counts: np.ndarray, spec: PlanSpec, pool: np.ndarray | None) -> tuple[Pieces, int, int, int]:
    """(the part of the epoch order that holds ``spec.dp_rank``'s, its first rank, its ranks, the
    padded count): node-sticky without a ``pool``, only the rank's node's part (``node_part``:
    memory O(shards / nodes), no full-length order); else the whole order."""
    if not spec.node_placed or pool is not None:
        full, padded = epoch_pieces(counts, spec, pool)
        return full, 0, spec.dp_size, padded
    weights = _weights(counts, spec)
    ranks = spec.dp_size // spec.num_nodes
    part, padded = memo(("part", spec.node) + _epoch_key(counts, weights, spec, None), lambda: node_part(
        counts, weights=weights, node=spec.node, num_nodes=spec.num_nodes, dp_size=spec.dp_size,
        drop_last=spec.drop_last, unit=spec.batch_size if spec.drop_last else 1, shuffle=spec.shuffle,
        seed=spec.seed, epoch=spec.epoch))
    return part, spec.node * ranks, ranks, padded


def epoch_order(counts: np.ndarray, spec: PlanSpec, pool: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """``epoch_pieces`` as sample ids (O(samples))."""
    pieces, padded = epoch_pieces(counts, spec, pool)
    return pieces.samples(_offsets(np.asarray(counts, dtype=np.int64))), padded


def split_even(order: np.ndarray, parts: int, drop_last: bool, unit: int = 1) -> tuple[list[np.ndarray], int]:
    """Cut ``order`` into ``parts`` equal contiguous pieces; returns (pieces, padded count).
    ``drop_last`` drops the remainder, leaving pieces of a multiple of ``unit`` samples."""
    n = len(order)
    if drop_last:
        per = n // parts // unit * unit
        padded = 0
    else:
        per = -(-n // parts) if n else 0
        padded = per * parts - n
        if padded:
            reps = np.resize(order, padded) if n else np.zeros(0, dtype=np.int64)
            order = np.concatenate([order, reps])
    return [order[i * per:(i + 1) * per] for i in range(parts)], padded


def _worker_pieces(rank: Pieces, spec: PlanSpec, worker: int) -> Pieces:
    """Worker ``worker``'s share of whole batches of its rank's order ``rank``, its runs in the
    order it reads them (shuffled: the largest of its last ``window`` runs moved to its end, see
    step 4 of the module docstring; ``in_turns``: every ``num_workers``-th batch, step 3)."""
    if spec.in_turns:
        return rank.blocks(spec.batch_size * spec.in_turns, worker, max(spec.num_workers, 1))
    bounds = _worker_bounds(len(rank), spec.num_workers, spec.batch_size)
    mine = rank.cut(bounds[worker], bounds[worker + 1])
    return mine.largest_run_last(spec.window) if spec.shuffle else mine


def _worker_bounds(n: int, num_workers: int, batch_size: int = 1) -> np.ndarray:
    """Where each worker's contiguous share of whole batches of a rank's ``n`` positions starts,
    plus the end (may pass ``n``: the rank's last batch may be short)."""
    batches = -(-n // batch_size)
    return np.linspace(0, batches, max(num_workers, 1) + 1).round().astype(np.int64) * batch_size


def build_plan(counts: np.ndarray, spec: PlanSpec, order: np.ndarray | None = None, *,
               shards_only: bool = False, head: int | None = None) -> ConsumerPlan:
    """The plan of consumer (``spec.dp_rank``, ``spec.worker_id``) for ``spec.epoch``.

    ``order`` replaces the epoch's global order (used to resume from a remainder);
    ``shards_only`` skips the per-sample shuffle (enough for prefetch and eviction schedules: run
    start times are then approximated by the runs' unshuffled positions). ``head``: a mixed plan
    of the consumer's first ``head`` positions only (its length and run times are the prefix's):
    another consumer's first chunks at a fraction of the cost (a part mix of 200,000 samples took
    0.8 s a plan); other plans are planned whole.
    """
    counts = np.asarray(counts, dtype=np.int64)
    offsets = _offsets(counts)
    segment, first, ranks, padded = _rank_segment(counts, spec, order)
    per = len(segment) // ranks
    mixed = _mixed_plan(counts, spec, segment, first, per, padded, shards_only, head)
    if mixed is not None:
        return mixed
    rank = segment.cut((spec.dp_rank - first) * per, (spec.dp_rank - first + 1) * per)
    mine = _worker_pieces(rank, spec, spec.worker_id)
    window = spec.window if spec.shuffle else 1
    if shards_only:
        starts, runs = mine.runs()
        return ConsumerPlan(runs, np.append(starts, len(mine)), None, None, len(mine), window, padded, starts)
    piece = mine.samples(offsets)
    run_of, starts, runs = piece_runs(piece, offsets)
    keys = run_of.astype(np.float64)
    if spec.shuffle:
        rng = np.random.default_rng([spec.seed, spec.epoch, 1, spec.dp_rank, spec.worker_id])
        # The last runs spread over fewer steps (run r over min(window, (R - r + 1) / 2)), so that
        # little is left to read once the last shard has arrived: (window + 1) / 2 runs otherwise
        # (2.5 for 4; 1.33 so), which a link-bound epoch pays as an idle tail.
        spread = np.minimum(float(window), (len(runs) - run_of + 1) / 2)
        keys += rng.random(len(piece)) * spread
    perm = np.argsort(keys, kind="stable")
    steps = np.searchsorted(keys[perm], np.arange(len(runs) + window), side="left")
    return ConsumerPlan(runs, steps, piece[perm], run_of[perm], len(piece), window, padded, starts)


def _mix_block(counts: np.ndarray, spec: PlanSpec, segment: Pieces, first: int, per: int) -> tuple[Pieces, bool] | None:
    """(the node's part of ``segment``, whether a part mix) when ``spec``'s epoch is a node mix
    or a part mix there (``segment`` holds the node's ranks from rank ``first`` on, ``per``
    positions each), else None."""
    node_ranks = spec.dp_size // spec.layout_nodes
    a = (spec.node * node_ranks - first) * per
    block = segment.cut(a, a + node_ranks * per)
    weights = _weights(counts, spec)
    share = int(weights[np.unique(block.shard)].sum()) if len(block.shard) else 0
    kw = dict(shuffle=spec.shuffle, mix_bytes=spec.mix_bytes, mix_from=spec.mix_from, epoch=spec.epoch,
              composed=spec.composed, spread_nodes=spec.num_nodes > 1 and spec.layout_nodes == 1, share_bytes=share)
    if node_mixes(**kw):
        return block, False
    if spec.layout_nodes == 1 and part_mixes(part_bytes=spec.part_bytes, **kw):  # see part_shuffle
        return block, True
    return None


def mixed_share(counts: np.ndarray, spec: PlanSpec, order: np.ndarray | None = None) -> np.ndarray | None:
    """The shards of ``spec``'s node's part when the epoch is a node mix there (every consumer of
    the node reads from all of them throughout the epoch: a node mix or a part mix), else None.
    O(shards)."""
    counts = np.asarray(counts, dtype=np.int64)
    segment, first, ranks, _ = _rank_segment(counts, spec, order)
    got = _mix_block(counts, spec, segment, first, len(segment) // ranks)
    return None if got is None else np.unique(got[0].shard[got[0].hi > got[0].lo])


def first_shards(counts: np.ndarray, spec: PlanSpec, order: np.ndarray | None = None) -> list[int | None]:
    """The shard of the first run of each of ``spec``'s rank's ``num_workers`` consumers, in
    worker order (None for one with nothing to read): what each one's first step needs, as
    ``build_plan`` with the same ``order`` plans it. Empty for a node-mixed or part-mixed epoch
    (its consumers read from every shard of the share at once). O(the rank's pieces)."""
    counts = np.asarray(counts, dtype=np.int64)
    segment, first, ranks, _ = _rank_segment(counts, spec, order)
    per = len(segment) // ranks
    if _mix_block(counts, spec, segment, first, per) is not None:
        return []
    rank = segment.cut((spec.dp_rank - first) * per, (spec.dp_rank - first + 1) * per)
    out: list[int | None] = []
    for w in range(spec.num_workers):
        _, runs = _worker_pieces(rank, spec, w).runs()
        out.append(runs[0][0] if runs else None)
    return out


def _mixed_plan(counts: np.ndarray, spec: PlanSpec, segment: Pieces, first: int, per: int, padded: int,
                shards_only: bool, head: int | None = None) -> ConsumerPlan | None:
    """The consumer's plan when its node's part is read as a node mix (``datacache.plan.node_shuffle``)
    or a part mix (``datacache.plan.part_shuffle``), else None. ``segment`` holds the node's ranks
    from rank ``first`` on, ``per`` positions each.
    ``shards_only``: the same runs, without ``samples``/``run_of`` (computed all the same: a
    mixed consumer's runs depend on its samples)."""
    got = _mix_block(counts, spec, segment, first, per)
    if got is None:
        return None
    block, parts = got
    node_ranks = spec.dp_size // spec.layout_nodes
    offsets = _offsets(counts)
    rank_start = (spec.dp_rank - spec.node * node_ranks) * per
    bounds = _worker_bounds(per, spec.num_workers, spec.batch_size)
    lo, hi = rank_start + bounds[spec.worker_id], rank_start + min(bounds[spec.worker_id + 1], per)
    hi = hi if head is None else min(hi, lo + max(0, head))
    chunk, rows = chunk_samples(spec.chunk_bytes, spec.shard_bytes, counts), 0
    if parts:  # the padding repeats end the segment: where the block does, its last ``padded``
        pad = padded if (spec.node * node_ranks - first + node_ranks) * per == len(segment) else 0
        rows = part_rows(spec.part_bytes, spec.shard_bytes, counts, spec.unit_rows)
        piece = part_piece(block, offsets, lo, hi, rows=rows,
                           window=PART_WINDOW, seed=spec.seed, epoch=spec.epoch, node=spec.node,
                           node_ranks=node_ranks, per=per, bounds=bounds, batch_size=spec.batch_size,
                           pad=min(pad, len(block)), narrow=spec.part_narrow,
                           strata=spec.part_strata)
        chunk = part_chunk(spec.batch_size, chunk)
    else:
        source = mix_positions(np.arange(lo, hi), len(block), seed=spec.seed, epoch=spec.epoch, node=spec.node)
        piece = block.at(source, offsets)
    if parts:
        c = chunk_runs(piece, offsets, chunk, 2, 0)
    else:  # the first batch waits for the first chunk only
        shards = len(np.unique(block.shard)) if spec.in_place else 0
        c = chunk_runs(piece, offsets, chunk, MIX_GROWTH, spec.batch_size, in_place_shards=shards)
    samples, run_of = (None, None) if shards_only else (piece, c["run_of"])
    return ConsumerPlan(c["runs"], c["steps"], samples, run_of, len(piece), c["window"], padded, c["starts"],
                        rows=c["rows"], parts=parts, unit_rows=min(rows, spec.unit_rows or rows),
                        row_in_run=None if shards_only else c["row_in_run"])


def remainder_order(counts: np.ndarray, spec: PlanSpec, consumed: list[int],
                    order: np.ndarray | None = None) -> np.ndarray:
    """Samples of an epoch not yet read, when worker ``w`` of every rank has read ``consumed[w]``.

    Ranks advance in lockstep (equal lengths, equal worker splits), so one rank's per-worker counts
    hold for all ranks. Padding repeats are dropped, so each real sample remains exactly once. The
    result is grouped by shard, shards in the order of ``order`` (default: the epoch's global
    order), so the resumed plan reads whole runs again.
    """
    counts = np.asarray(counts, dtype=np.int64)
    done: list[np.ndarray] = []
    rest: list[np.ndarray] = []
    for r in range(spec.dp_size):
        for w in range(spec.num_workers):
            sub = PlanSpec(**{**spec.__dict__, "dp_rank": r, "worker_id": w})
            samples = build_plan(counts, sub, order=order).samples
            assert samples is not None
            done.append(samples[:consumed[w]])
            rest.append(samples[consumed[w]:])
    if not rest:
        return np.zeros(0, dtype=np.int64)
    rest_all = np.unique(np.concatenate(rest))
    rest_all = rest_all[~np.isin(rest_all, np.concatenate(done))]
    offsets = _offsets(counts)
    shard_rank = np.empty(len(counts), dtype=np.int64)
    first_seen = np.unique(epoch_pieces(counts, spec, pool=order)[0].shard, return_index=True)
    shard_rank[first_seen[0]] = first_seen[1]
    shard = np.searchsorted(offsets, rest_all, side="right") - 1
    return rest_all[np.lexsort((rest_all, shard_rank[shard]))]


@dataclass(frozen=True)
class ConsumerPlan:
    """One consumer's reads for one epoch (see ``datacache.plan.epoch``'s module docstring).

    ``runs``: (shard, lo, hi) per run, in the order they are needed: the run reads local indices
    within ``[lo, hi)`` of ``shard``. ``steps``: positions where each step starts, plus the end.
    ``samples``/``run_of``: global sample id and run of each read position (``None`` for a
    shards-only plan). ``padded``: repeats added to this epoch across all ranks. ``rows``: the
    rows each run reads (a mixed plan's). ``parts``: a part mix's plan, whose runs are read part by
    part (``ShardSource.load_rows``) rather than as whole shards; ``unit_rows``: its samples read
    together, the shard-local rows ``k * unit_rows .. (k + 1) * unit_rows - 1`` (a dcz block's
    where the writer recorded them, else a part's; ``datacache.read.stash``).
    """

    runs: list[tuple[int, int, int]]
    steps: np.ndarray
    samples: np.ndarray | None
    run_of: np.ndarray | None
    length: int
    window: int
    padded: int
    run_starts: np.ndarray
    rows: Sequence[np.ndarray] | None = None  # a Ragged (datacache.plan.ragged) where built here
    parts: bool = False
    unit_rows: int = 0
    row_in_run: np.ndarray | None = None  # a mixed plan's: each position's place among its run's rows

    def __len__(self) -> int:
        return self.length

    @cached_property
    def shard_sequence(self) -> list[int]:
        """Shards in the order this consumer needs them (a shard may appear more than once)."""
        return [r[0] for r in self.runs]

    def run_times(self, epoch: int) -> list[float]:
        """The node-clock time at which each run's shard is read: ``epoch + run start / length``
        (run starts in the unshuffled order, so a shards-only plan gives the same times)."""
        n = max(self.length, 1)
        return [epoch + float(a) / n for a in self.run_starts]

    def shard_times(self, epoch: int) -> list[tuple[int, float]]:
        """(shard, time) of each run on the node clock (see ``run_times``)."""
        return list(zip(self.shard_sequence, self.run_times(epoch)))


def piece_runs(piece: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
    """Run index of each position of ``piece``, run start positions, and (shard, lo, hi) per run."""
    shard_of = np.searchsorted(offsets, piece, side="right") - 1
    if len(piece) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), []
    starts = np.flatnonzero(np.concatenate([[True], shard_of[1:] != shard_of[:-1]]))
    run_of = np.cumsum(np.isin(np.arange(len(piece)), starts)) - 1
    local = piece - offsets[shard_of]
    lo = np.minimum.reduceat(local, starts)
    hi = np.maximum.reduceat(local, starts) + 1
    runs = list(zip(shard_of[starts].tolist(), lo.tolist(), hi.tolist()))
    return run_of, starts, runs
