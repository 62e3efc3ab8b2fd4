"""``ConsumerPlan``: one consumer's reads for one epoch, as ``datacache.plan.build_plan`` returns
them, and ``piece_runs``, which cuts a read order into runs of one shard each. Pure data and a pure
function; a plan is immutable once built (thread-safe to share)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["ConsumerPlan", "piece_runs"]


@dataclass(frozen=True)
class ConsumerPlan:
    """One consumer's reads for one epoch (see ``datacache.plan``'s module docstring).

    ``runs``: (shard, lo, hi) per run, in the order they are needed: the run reads local indices
    within ``[lo, hi)`` of ``shard``. ``steps``: positions where each step starts, plus the end.
    ``samples``/``run_of``: global sample id and run of each read position (``None`` for a
    shards-only plan). ``padded``: repeats added to this epoch across all ranks. ``rows``: the
    rows each run reads (a mixed plan's). ``parts``: a part mix's plan, whose runs are read part by
    part (``ShardSource.load_rows``) rather than as whole shards; ``unit_rows``: its samples read
    together, the shard-local rows ``k * unit_rows .. (k + 1) * unit_rows - 1`` (a dcz block's
    where the writer recorded them, else a part's; ``datacache._stash``).
    """

    runs: list[tuple[int, int, int]]
    steps: np.ndarray
    samples: np.ndarray | None
    run_of: np.ndarray | None
    length: int
    window: int
    padded: int
    run_starts: np.ndarray
    rows: Sequence[np.ndarray] | None = None  # a Ragged (datacache._ragged) where built here
    parts: bool = False
    unit_rows: int = 0

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
