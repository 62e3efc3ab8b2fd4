"""Shuffle quality for ``tools/bench.py``: distinct classes per batch on class-sorted data.

Every system writes the bench samples in id order (``make_sample(0..n-1)``, one writer process,
no reordering), so the write position is the sample id. The benchmark data is *class-sorted*:
``class = id * CLASSES // n`` with ``CLASSES = 100`` (100 contiguous classes of n/100 samples:
``id // 80`` on an 8,000-sample dataset; 76-77 samples per class on the 7,629-sample 500 MB
dataset, 24-25 on the 2,441-sample ``--quick`` one).

Quality = (mean distinct classes per batch) / (the same for a uniform random permutation), with
the random figure computed exactly for each batch's size: a batch of ``b`` samples of a uniform
random permutation is a uniform ``b``-subset, so class ``c`` (``s_c`` samples) is missing from it
with probability ``C(n - s_c, b) / C(n, b)``. 1.0 is as good as a global shuffle; a batch read
from one shard of sorted data scores about 1 / (classes per random batch).

Thread-safety: ``BatchQuality`` is used by one thread (the runner's measured loop); the functions
are pure.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

CLASSES = 100
CURVE_STEPS = 20  # quality per 5 % of the epoch


def class_of(ids: np.ndarray | list[int], n: int, classes: int = CLASSES) -> np.ndarray:
    """The class of each sample id on the class-sorted dataset of ``n`` samples."""
    return np.asarray(ids, dtype=np.int64) * classes // n


@lru_cache(maxsize=4096)
def expected_distinct(n: int, b: int, classes: int = CLASSES) -> float:
    """Mean distinct classes in a uniform random ``b``-subset of the class-sorted ``n`` samples."""
    sizes = np.bincount(class_of(np.arange(n), n, classes), minlength=classes)
    b = min(b, n)
    total = 0.0
    for s in np.unique(sizes):
        count = int((sizes == s).sum())
        rest = n - int(s)
        # C(rest, b) / C(n, b) = prod_{i<b} (rest - i) / (n - i), zero once rest < b
        missing = 0.0 if rest < b else math.exp(sum(math.log((rest - i) / (n - i)) for i in range(b)))
        total += count * (1.0 - missing)
    return total


class BatchQuality:
    """Accumulates one epoch's batches (sample ids) of one consumer stream (a rank's loader)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sizes: list[int] = []
        self.distinct: list[int] = []

    def add(self, ids: list[int] | np.ndarray) -> None:
        if len(ids):
            self.sizes.append(len(ids))
            self.distinct.append(int(np.unique(class_of(ids, self.n)).size))

    def summary(self) -> dict[str, object]:
        """``quality`` (overall), ``classes_per_batch`` and its random figure, the sums (to pool
        ranks), and ``quality_curve``: quality of the batches that begin in each 5 % of the epoch."""
        if not self.sizes:
            return {}
        expected = [expected_distinct(self.n, b) for b in self.sizes]
        dsum, esum = float(sum(self.distinct)), float(sum(expected))
        starts = np.cumsum([0] + self.sizes[:-1]) / max(sum(self.sizes), 1)
        step = np.minimum((starts * CURVE_STEPS).astype(int), CURVE_STEPS - 1)
        curve = []
        for k in range(CURVE_STEPS):
            sel = step == k
            e = float(np.sum(np.asarray(expected)[sel]))
            curve.append(round(float(np.sum(np.asarray(self.distinct)[sel])) / e, 3) if e else None)
        return {"quality": round(dsum / esum, 4), "classes_per_batch": round(dsum / len(self.sizes), 2),
                "random_classes_per_batch": round(esum / len(self.sizes), 2), "distinct_sum": dsum,
                "expected_sum": esum, "quality_curve": curve}


def pooled(parts: list[tuple[float, float]]) -> float | None:
    """Quality of several consumers' batches together, from their (distinct_sum, expected_sum)."""
    e = sum(p[1] for p in parts)
    return round(sum(p[0] for p in parts) / e, 4) if e else None


def batch_quality(batches: list[np.ndarray] | list[list[int]], n: int) -> float:
    """Quality of ``batches`` (sample ids of the class-sorted ``n`` samples) as the bench reports
    it (``BatchQuality``'s ``quality``), unrounded: their distinct classes over a uniform random
    permutation's batches of the same sizes. Tests pass full batches only."""
    distinct = sum(int(np.unique(class_of(b, n)).size) for b in batches)
    return distinct / sum(expected_distinct(n, len(b)) for b in batches)
