"""A part-mixed consumer reads each unit once (``read_plan``, ``Stash``). A pure function and a
thread-safe class.

In a part mix (``datacache.plan.part_shuffle``) a consumer's batch draws one or two samples from each of
about 64 parts, so a unit's samples for this consumer lie in many of its runs, and a run is
mostly one sample. Loaded and read run by run, each sample cost a ``load_rows`` and a
``read_rows`` of its own (and, in a compressed block, a decompression of the block): the 200,000
x 4 KB bench case spent minutes of CPU on it. Instead the first run of this consumer that reaches
a unit (a dcz block; its *leader*) loads and reads all of the consumer's rows of that unit at
once, and keeps those of later runs in a ``Stash`` until their runs come. The leader loads that
unit anyway, so no byte is fetched earlier; the first chunk's runs read only their own rows.
The stash holds at most the consumer's rows of the units it has reached and not used up: across
the node, the sliding window of parts (about ``PART_WINDOW / 2`` parts' samples over the node's
consumers) plus the epoch's end share. The leader reads them with ``copy=True``, so no
decompressed block's buffer outlives its read (one copy of a block's rows for all of them, not
one a sample); a raw block's samples stay views of the shard file's mapping, which costs no
memory of the process's own and which no later read changes. A run with nothing to read (a
*follower*: its rows all come from earlier runs' reads) never reaches the consumer's prefetch and
decode stages: the consumer takes its samples from the stash in its own thread, a dictionary lookup
per sample.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..plan.ragged import Ragged

__all__ = ["Stash", "read_plan"]


def read_plan(shards: list[int], rows: "list[np.ndarray] | Ragged", unit_rows: int, *, alone: int = 0) -> Ragged:
    """The rows each run loads and reads, for runs in reading order (``shards[i]``, ``rows[i]``:
    run ``i``'s shard and rows): all of the runs' rows of the units (``row // unit_rows`` of a
    shard) that run ``i`` is the first to reach. A run's own rows that are not in its list come
    from an earlier run's read (``Stash``). The first ``alone`` runs (the first chunk: the first
    batch waits for them) read their own rows only. ``unit_rows`` < 1: each run reads its own.
    A row in several runs (a padded plan's repeat) is read once, by its unit's leader, for its
    first run after that; the stash gives it once, so a later run reads it again itself."""
    rows = Ragged.of(rows)
    if unit_rows < 1 or len(rows) <= alone:
        return rows
    sizes = rows.sizes()
    run = np.repeat(np.arange(len(rows), dtype=np.int64), sizes)
    flat = rows.flat
    key = (np.repeat(np.asarray(shards, dtype=np.int64), sizes) << 32) | (flat // unit_rows)
    _, inverse = np.unique(key, return_inverse=True)
    inverse = inverse.reshape(-1)
    leader = np.full(int(inverse.max()) + 1 if len(inverse) else 0, len(rows), dtype=np.int64)
    later = run >= alone  # the first chunk's rows are read by their own runs
    np.minimum.at(leader, inverse[later], run[later])
    lead = np.where(later, leader[inverse], run)  # per row: the run that reads it
    order = np.lexsort((flat, lead))
    flat, lead = flat[order], lead[order]
    # A padded plan repeats a few samples, at times in one consumer: each run reads a row once.
    once = np.ones(len(flat), dtype=bool)
    once[1:] = (flat[1:] != flat[:-1]) | (lead[1:] != lead[:-1])
    flat, lead = flat[once], lead[once]
    return Ragged(flat, np.searchsorted(lead, np.arange(len(rows) + 1)))


class Stash:
    """Samples read ahead of their run, by (shard, row): ``put_many`` by a leader's read,
    ``take_many`` once by the run that needs them. Counts its bytes (``nbytes``, of the samples'
    buffers). Thread-safe (the consumer's decode thread puts, its own thread takes): one lock,
    held for the dictionary updates only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[int, int], tuple[Any, int]] = {}
        self.nbytes = 0

    def put_many(self, shard: int, samples: dict[int, Any]) -> None:
        """Keep ``samples`` (shard-local row -> sample) of shard ``shard`` for their runs. They
        must be read with ``ShardSource.read_rows(copy=True)`` (see the module docstring), so that
        no block buffer outlives its read."""
        sized = [((shard, row), (sample, _nbytes(sample))) for row, sample in samples.items()]
        with self._lock:
            self._held.update(sized)
            self.nbytes += sum(size for _, (_, size) in sized)

    def take_many(self, shard: int, rows: list[int]) -> dict[int, Any]:
        """The kept samples of shard ``shard`` at ``rows`` (distinct), each removed from the
        stash; rows that none is kept for are left out."""
        out: dict[int, Any] = {}
        with self._lock:
            for row in rows:
                held = self._held.pop((shard, row), None)
                if held is not None:
                    out[row] = held[0]
                    self.nbytes -= held[1]
        return out

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self.nbytes = 0


def _nbytes(sample: Any) -> int:
    """The bytes of a sample's fields (arrays, bytes, strings), roughly; 0 for what has none."""
    if type(sample) is dict:  # noqa: E721 - the common case, without a call a field
        return sum(v.nbytes if type(v) is np.ndarray else _nbytes(v) for v in sample.values())  # noqa: E721
    if isinstance(sample, dict):
        return sum(_nbytes(v) for v in sample.values())
    return int(getattr(sample, "nbytes", 0) or (len(sample) if isinstance(sample, (bytes, str)) else 0))
