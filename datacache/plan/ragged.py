"""``Ragged``: a read-only sequence of integer arrays kept as one flat array and its cuts. Thread-safe (immutable).

A part-mixed consumer's plan has one run per shard and chunk, about one per sample on small
samples (195,000 on the 200,000 x 4 KB bench case). Its rows as a list of that many small arrays
took 0.14 s to build and another 0.25 s to flatten again (``datacache.read.stash.read_plan``) before the first
batch; kept flat, both are a few numpy calls and each run's rows a slice.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["Ragged"]


class Ragged:
    """Arrays ``flat[cuts[i]:cuts[i + 1]]`` for ``i`` in ``range(len(cuts) - 1)`` (views of ``flat``)."""

    __slots__ = ("flat", "cuts")

    def __init__(self, flat: np.ndarray, cuts: np.ndarray) -> None:
        """``flat``: the arrays' values, one after the other; ``cuts``: where each starts, then
        ``len(flat)`` (non-decreasing, starting at 0)."""
        self.flat = np.asarray(flat, dtype=np.int64)
        self.cuts = np.asarray(cuts, dtype=np.int64)
        if len(self.cuts) < 1 or self.cuts[0] != 0 or self.cuts[-1] != len(self.flat):
            raise ValueError(f"cuts must run from 0 to {len(self.flat)}, not {self.cuts[:1]} .. {self.cuts[-1:]}")

    @classmethod
    def of(cls, arrays: "list[np.ndarray] | Ragged") -> "Ragged":
        """``arrays`` as a Ragged (itself if it is one)."""
        if isinstance(arrays, Ragged):
            return arrays
        sizes = np.array([len(a) for a in arrays], dtype=np.int64)
        flat = np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays]) if len(arrays) else np.zeros(0, np.int64)
        return cls(flat, np.concatenate([[0], np.cumsum(sizes)]))

    def sizes(self) -> np.ndarray:
        """Each array's length."""
        return np.diff(self.cuts)

    def __len__(self) -> int:
        return len(self.cuts) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} arrays")
        i %= len(self)
        return self.flat[self.cuts[i]:self.cuts[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        flat, cuts = self.flat, self.cuts.tolist()
        return (flat[a:b] for a, b in zip(cuts, cuts[1:]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ragged):
            return NotImplemented
        return np.array_equal(self.flat, other.flat) and np.array_equal(self.cuts, other.cuts)

    __hash__ = None  # type: ignore[assignment]
