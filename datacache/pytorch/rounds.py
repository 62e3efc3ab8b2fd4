"""Where a DataLoader's workers stand, from the number of batches the loader has handed out.

torch's ``DataLoader`` (``in_order=True``, its default) takes an ``IterableDataset``'s batches from
its workers in turn: worker 0, 1, ..., ``W - 1``, 0, ..., skipping a worker once it has no batch
left, and it starts every epoch at worker 0. A ``StreamingDataset`` deals each worker a known list
of whole batches (the plan's step 3), so after the loader has handed out ``k`` batches the main
process knows exactly how far every worker's plan has been delivered: ``Rounds.state(k)``. That is
the resume state ``datacache.DataLoader`` saves, with no per-step snapshot from each worker (which
is what makes torchdata's ``StatefulDataLoader`` slower per batch).

A resumed epoch must come in the uninterrupted order, yet torch starts again at worker 0: the
state records the plan worker whose batch comes next (``ResumeState.next_worker``), and loader
worker ``p`` then plays plan worker ``(p + next_worker) % W`` (``StreamingDataset``'s ``__iter__``).

Immutable values and pure functions (thread-safe). ``on_error="skip"`` is the one case where a
worker's batches end later in its plan than counted here (a skipped shard's samples are passed
over): a state saved then lies behind, and a resume delivers those few samples again rather than
losing any.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from ..plan.resume import ResumeState

__all__ = ["WorkerBatches", "Rounds", "delivered"]


@dataclass(frozen=True)
class WorkerBatches:
    """One plan worker's batches from where it starts this iteration: plan position ``start``
    (a batch boundary), plan length ``length``, batch size ``size`` (1: samples mode), and in
    per_stream mode the plan position after each batch (``cuts``; otherwise every ``size``)."""

    start: int
    length: int
    size: int
    cuts: tuple[int, ...] | None = None

    @property
    def count(self) -> int:
        """Batches this worker yields."""
        return len(self.cuts) if self.cuts is not None else -(-max(self.length - self.start, 0) // self.size)

    def end(self, j: int) -> int:
        """Plan position after its first ``j`` batches."""
        if j <= 0:
            return self.start
        return self.cuts[j - 1] if self.cuts is not None else min(self.start + j * self.size, self.length)


def delivered(counts: Sequence[int], first: int, k: int) -> tuple[list[int], int]:
    """(batches delivered per worker, the worker whose batch comes next) after ``k`` batches of
    a round-robin over workers with ``counts`` batches each, starting at worker ``first`` and
    skipping a worker once it has none left. ``ValueError`` if ``k`` exceeds the total."""
    w = len(counts)
    if not 0 <= k <= sum(counts):
        raise ValueError(f"{k} batches delivered, but the workers hold {sum(counts)}")
    if k == 0:
        return [0] * w, first
    cycle = [(first + i) % w for i in range(w)]
    ranked = sorted(counts)
    prefix = np.concatenate([[0], np.cumsum(ranked)])

    def upto(t: int) -> int:  # batches handed out by the end of round t: sum of min(count, t)
        i = bisect_right(ranked, t)
        return int(prefix[i]) + t * (w - i)

    lo, hi = 0, max(counts)  # the last full round t: upto(t) <= k < upto(t + 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if upto(mid) <= k else (lo, mid - 1)
    t, extra = lo, k - upto(lo)
    done = [min(c, t) for c in counts]
    more = [p for p in cycle if counts[p] > t]  # the round t + 1, in turn
    for p in more[:extra]:
        done[p] += 1
    last = more[extra - 1] if extra else [p for p in cycle if counts[p] >= t][-1]
    return done, (last + 1) % w


@dataclass(frozen=True)
class Rounds:
    """A loader iteration's start (``base``: the rank's state in the loader's layout, every
    worker's count its start position, ``next_worker`` the plan worker the loader takes first)
    and, built on first use, each plan worker's batches (``make_workers()``)."""

    base: ResumeState
    make_workers: Callable[[], Sequence[WorkerBatches]]

    @cached_property
    def workers(self) -> tuple[WorkerBatches, ...]:
        return tuple(self.make_workers())

    def state(self, k: int) -> ResumeState:
        """The rank's complete state once the loader has handed out ``k`` batches."""
        ws = self.workers
        done, nxt = delivered([w.count for w in ws], self.base.next_worker, k)
        return replace(self.base, consumed=tuple(w.end(d) for w, d in zip(ws, done)), next_worker=nxt)
