"""An epoch order held at the shard level: ``Pieces``, a sequence of (shard, lo, hi) ranges.

The sample at position ``p`` of an order is ``offsets[shard] + local`` for the piece holding ``p``;
a piece reads the shard-local indices ``lo .. hi - 1`` in order. A whole epoch's order is one piece
per shard (more only around the few samples that move between nodes, padding, or a resume's
holes), so the plan builds, cuts and pads orders in O(shards) and turns only one consumer's part
into sample ids. Immutable; thread-safe.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["Pieces"]


def _i64(a: object) -> np.ndarray:
    return np.asarray(a, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class Pieces:
    """(shard, lo, hi) per piece, in read order (see the module docstring)."""

    shard: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    @staticmethod
    def empty() -> "Pieces":
        z = np.zeros(0, dtype=np.int64)
        return Pieces(z, z, z)

    @staticmethod
    def whole(shards: np.ndarray, counts: np.ndarray) -> "Pieces":
        """Every sample of ``shards`` (in that order), each non-empty shard one piece."""
        shards = _i64(shards)
        shards = shards[_i64(counts)[shards] > 0]
        return Pieces(shards, np.zeros(len(shards), dtype=np.int64), _i64(counts)[shards])

    @staticmethod
    def from_samples(samples: np.ndarray, offsets: np.ndarray) -> "Pieces":
        """The order ``samples`` (global ids) as pieces: runs of consecutive ids within a shard."""
        samples = _i64(samples)
        if len(samples) == 0:
            return Pieces.empty()
        shard = np.searchsorted(offsets, samples, side="right") - 1
        brk = np.flatnonzero((np.diff(samples) != 1) | (np.diff(shard) != 0)) + 1
        starts = np.concatenate([[0], brk])
        ends = np.concatenate([brk, [len(samples)]])
        local = samples - offsets[shard]
        return Pieces(shard[starts], local[starts], local[ends - 1] + 1)

    @staticmethod
    def concat(parts: list["Pieces"]) -> "Pieces":
        parts = [p for p in parts if len(p.shard)]
        if not parts:
            return Pieces.empty()
        return Pieces(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("shard", "lo", "hi")))

    @cached_property
    def ends(self) -> np.ndarray:
        """Position after each piece."""
        return np.cumsum(self.hi - self.lo, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def cut(self, a: int, b: int) -> "Pieces":
        """Positions ``a .. b - 1``."""
        a, b = max(int(a), 0), min(int(b), len(self))
        if b <= a:
            return Pieces.empty()
        i = int(np.searchsorted(self.ends, a, side="right"))
        j = int(np.searchsorted(self.ends, b, side="left"))
        shard, lo, hi = self.shard[i:j + 1].copy(), self.lo[i:j + 1].copy(), self.hi[i:j + 1].copy()
        before = self.ends[i] - (self.hi[i] - self.lo[i])
        lo[0] += a - before
        hi[-1] -= self.ends[j] - b
        return Pieces(shard, lo, hi)

    def blocks(self, size: int, first: int, step: int) -> "Pieces":
        """The positions of blocks ``first``, ``first + step``, ``first + 2 * step``, ... in that
        order, block ``k`` being positions ``k * size .. (k + 1) * size - 1`` (the last one may be
        short): one consumer's batches when a rank's batches are dealt in turn. O(pieces + blocks)."""
        n = len(self)
        if n == 0 or first >= -(-n // size):
            return Pieces.empty()
        starts = self.ends - (self.hi - self.lo)
        mine = np.arange(first, -(-n // size), step, dtype=np.int64) * size
        cuts = np.unique(np.concatenate([starts, mine, np.minimum(mine + size, n)]))
        cuts = cuts[cuts < n]
        seg_end = np.append(cuts[1:], n)
        keep = (cuts // size) % step == first  # a segment lies in one block: every block bound of ours is a cut
        a, b = cuts[keep], seg_end[keep]
        i = np.searchsorted(self.ends, a, side="right")  # its piece: every piece start is a cut too
        lo = self.lo[i] + (a - starts[i])
        return Pieces(self.shard[i], lo, lo + (b - a))

    def largest_run_last(self, among: int) -> "Pieces":
        """The same pieces with the largest of the last ``among`` runs (consecutive pieces of one
        shard, as ``runs`` merges them; never the first run, and of equal ones the latest) moved
        to the end. O(pieces)."""
        keep = self.hi > self.lo
        shard, lo, hi = self.shard[keep], self.lo[keep], self.hi[keep]
        if len(shard) == 0:
            return self
        first = np.flatnonzero(np.concatenate([[True], shard[1:] != shard[:-1]]))
        bounds = np.append(first, len(shard))
        sizes = np.add.reduceat(hi - lo, first)
        lowest = max(1, len(first) - int(among))
        if lowest >= len(first) - 1:
            return Pieces(shard, lo, hi)
        tail = sizes[lowest:]
        pick = lowest + len(tail) - 1 - int(np.argmax(tail[::-1]))  # the latest of the largest
        if pick == len(first) - 1:
            return Pieces(shard, lo, hi)
        a, b = bounds[pick], bounds[pick + 1]
        order = np.concatenate([np.arange(a), np.arange(b, len(shard)), np.arange(a, b)])
        return Pieces(shard[order], lo[order], hi[order])

    def take(self, mask: np.ndarray) -> "Pieces":
        return Pieces(self.shard[mask], self.lo[mask], self.hi[mask])

    def resize(self, n: int) -> "Pieces":
        """The first ``n`` positions of this order repeated cyclically (``np.resize``)."""
        total = len(self)
        if n <= 0 or total == 0:
            return Pieces.empty()
        reps, rest = divmod(int(n), total)
        return Pieces.concat([self] * reps + [self.cut(0, rest)])

    def samples(self, offsets: np.ndarray) -> np.ndarray:
        """The global sample id at every position (O(len))."""
        lengths = self.hi - self.lo
        total = int(lengths.sum())
        if total == 0:
            return np.zeros(0, dtype=np.int64)
        first = _i64(offsets)[self.shard] + self.lo
        return np.repeat(first - (self.ends - lengths), lengths) + np.arange(total, dtype=np.int64)

    def at(self, positions: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """The global sample ids at ``positions`` (each in ``[0, len)``; O(k log pieces))."""
        q = _i64(positions)
        i = np.searchsorted(self.ends, q, side="right")
        start = self.ends[i] - (self.hi[i] - self.lo[i])
        return _i64(offsets)[self.shard[i]] + self.lo[i] + (q - start)

    def runs(self) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """(start position of each run, (shard, lo, hi) per run): consecutive pieces of one shard
        merge into one run spanning their local ranges (as ``plan._runs`` does for samples)."""
        keep = self.hi > self.lo
        shard, lo, hi = self.shard[keep], self.lo[keep], self.hi[keep]
        if len(shard) == 0:
            return np.zeros(0, dtype=np.int64), []
        ends = np.cumsum(hi - lo)
        first = np.flatnonzero(np.concatenate([[True], shard[1:] != shard[:-1]]))
        starts = np.concatenate([[0], ends[:-1]])[first]
        runs = list(zip(shard[first].tolist(), np.minimum.reduceat(lo, first).tolist(),
                        np.maximum.reduceat(hi, first).tolist()))
        return starts, runs
