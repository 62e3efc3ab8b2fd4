"""The epoch plan: which samples each consumer reads, in which order. A pure function.

A plan depends only on (shard sample counts, seed, epoch, shuffle, window, drop_last, data-parallel
size and rank, number of workers, worker id), so every process can compute every other process's
plan: that is how a consumer knows its future reads exactly, and how the node's cache learns the
next use of every shard for clairvoyant eviction. Steps:

1. Global order: the shards in a seeded permutation (per seed and epoch), each shard's samples
   contiguous. Every rank computes the same order.
2. Ranks: the order is cut into ``dp_size`` equal contiguous parts. ``drop_last=False`` pads the
   order by repeating samples from its start until it divides evenly (``padded`` counts them);
   ``drop_last=True`` drops the remainder. Every rank therefore reads the same number of samples,
   and, since the worker split below is the same everywhere, yields the same number of batches.
3. Workers: a rank's part is cut into ``num_workers`` contiguous parts (sizes differ by at most 1).
4. Window shuffle: a worker's samples are shuffled within windows of ``window`` consecutive shard
   runs. A larger window is more random but keeps more shards open and pinned at once; the default
   of 4 shards keeps a consumer's working set small while mixing samples of 4 shards per batch.

Exactly once: across all ranks and workers of an epoch every sample appears once, plus ``padded``
repeats when ``drop_last=False``. Resuming a partly consumed epoch (possibly with another world
size) uses ``remainder_order`` to get the not-yet-read samples and splits them the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["PlanSpec", "ConsumerPlan", "global_order", "split_even", "build_plan", "remainder_order",
           "DEFAULT_WINDOW"]

DEFAULT_WINDOW = 4


@dataclass(frozen=True, kw_only=True)
class PlanSpec:
    """Everything a plan depends on besides the shard sizes. Immutable."""

    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    window: int = DEFAULT_WINDOW
    drop_last: bool = False
    dp_size: int = 1
    dp_rank: int = 0
    num_workers: int = 1
    worker_id: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} not in [0, {self.dp_size})")
        if not 0 <= self.worker_id < max(self.num_workers, 1):
            raise ValueError(f"worker_id {self.worker_id} not in [0, {self.num_workers})")
        if self.window < 1:
            raise ValueError("window must be >= 1 shard")


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])


def global_order(counts: np.ndarray, spec: PlanSpec) -> np.ndarray:
    """Global sample ids of one epoch, shard-contiguous, shards permuted when shuffling."""
    counts = np.asarray(counts, dtype=np.int64)
    offsets = _offsets(counts)
    shards = np.arange(len(counts))
    if spec.shuffle:
        shards = np.random.default_rng([spec.seed, spec.epoch, 0]).permutation(len(counts))
    parts = [np.arange(offsets[s], offsets[s + 1], dtype=np.int64) for s in shards]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def split_even(order: np.ndarray, parts: int, drop_last: bool) -> tuple[list[np.ndarray], int]:
    """Cut ``order`` into ``parts`` equal contiguous pieces; returns (pieces, padded count)."""
    n = len(order)
    if drop_last:
        per = n // parts
        padded = 0
    else:
        per = -(-n // parts) if n else 0
        padded = per * parts - n
        if padded:
            reps = np.resize(order, padded) if n else np.zeros(0, dtype=np.int64)
            order = np.concatenate([order, reps])
    return [order[i * per:(i + 1) * per] for i in range(parts)], padded


def _worker_piece(rank_seq: np.ndarray, num_workers: int, worker_id: int) -> np.ndarray:
    bounds = np.linspace(0, len(rank_seq), max(num_workers, 1) + 1).round().astype(np.int64)
    return rank_seq[bounds[worker_id]:bounds[worker_id + 1]]


@dataclass(frozen=True)
class ConsumerPlan:
    """One consumer's reads for one epoch.

    ``samples``: global sample ids in read order (``None`` for a shards-only plan). ``windows``:
    per window, the (start, end) positions it covers and the shards it needs, in run order.
    ``padded``: repeats in this epoch across all ranks.
    """

    samples: np.ndarray | None
    length: int
    windows: list[tuple[int, int, list[int]]]
    padded: int

    def __len__(self) -> int:
        return self.length

    @cached_property
    def shard_sequence(self) -> list[int]:
        """Shards in the order this consumer needs them (a shard may appear more than once)."""
        return [s for _, _, shards in self.windows for s in shards]

    def shard_times(self, epoch: int) -> list[tuple[int, float]]:
        """(shard, time) of each shard need on the node clock: ``epoch + window start / length``."""
        n = max(self.length, 1)
        return [(s, epoch + a / n) for a, _, shards in self.windows for s in shards]


def _windows(piece: np.ndarray, offsets: np.ndarray, window: int) -> list[tuple[int, int, list[int]]]:
    """Group a consumer's samples into windows touching at most ``window`` distinct shards each."""
    if len(piece) == 0:
        return []
    shard_of = np.searchsorted(offsets, piece, side="right") - 1
    starts = np.flatnonzero(np.concatenate([[True], shard_of[1:] != shard_of[:-1]])).tolist()
    run_shards = shard_of[starts].tolist()
    starts.append(len(piece))
    out: list[tuple[int, int, list[int]]] = []
    begin, shards = 0, {}  # dict as an ordered set
    for i, s in enumerate(run_shards):
        if s not in shards and len(shards) == window:
            out.append((begin, starts[i], list(shards)))
            begin, shards = starts[i], {}
        shards[s] = None
    out.append((begin, len(piece), list(shards)))
    return out


def build_plan(counts: np.ndarray, spec: PlanSpec, order: np.ndarray | None = None, *,
               shards_only: bool = False, reshuffle: bool = True) -> ConsumerPlan:
    """The plan of consumer (``spec.dp_rank``, ``spec.worker_id``) for ``spec.epoch``.

    ``order`` replaces the epoch's global order (used to resume from a remainder);
    ``shards_only`` skips the per-sample shuffle (enough for prefetch and eviction schedules);
    ``reshuffle=False`` keeps ``order`` as it is within windows (a remainder is already shuffled).
    """
    counts = np.asarray(counts, dtype=np.int64)
    offsets = _offsets(counts)
    if order is None:
        order = global_order(counts, spec)
    pieces, padded = split_even(order, spec.dp_size, spec.drop_last)
    piece = _worker_piece(pieces[spec.dp_rank], spec.num_workers, spec.worker_id)
    windows = _windows(piece, offsets, spec.window)
    samples = None
    if not shards_only:
        samples = piece.copy()
        if spec.shuffle and reshuffle:
            rng = np.random.default_rng([spec.seed, spec.epoch, 1, spec.dp_rank, spec.worker_id])
            for a, b, _ in windows:
                samples[a:b] = rng.permutation(samples[a:b])
    return ConsumerPlan(samples, len(piece), windows, padded)


def remainder_order(counts: np.ndarray, spec: PlanSpec, consumed: list[int],
                    order: np.ndarray | None = None) -> np.ndarray:
    """Samples of an epoch not yet read, when worker ``w`` of every rank has read ``consumed[w]``.

    Ranks advance in lockstep (equal lengths, equal worker splits), so one rank's per-worker counts
    hold for all ranks. Padding repeats are dropped, so each real sample remains exactly once.
    """
    counts = np.asarray(counts, dtype=np.int64)
    base = global_order(counts, spec) if order is None else order
    done: list[np.ndarray] = []
    rest: list[np.ndarray] = []
    for r in range(spec.dp_size):
        for w in range(spec.num_workers):
            sub = PlanSpec(**{**spec.__dict__, "dp_rank": r, "worker_id": w})
            # as the dataset builds it: a remainder order is not reshuffled again
            samples = build_plan(counts, sub, order=base, reshuffle=order is None).samples
            assert samples is not None
            done.append(samples[:consumed[w]])
            rest.append(samples[consumed[w]:])
    if not rest:
        return np.zeros(0, dtype=np.int64)
    rest_all = np.concatenate(rest)
    rest_all = rest_all[~np.isin(rest_all, np.concatenate(done))]
    _, first = np.unique(rest_all, return_index=True)
    return rest_all[np.sort(first)]
