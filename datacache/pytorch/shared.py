"""What a ``StreamingDataset`` shares with its DataLoader workers through shared memory, which they
inherit (fork or spawn): ints (``shared_int``), its own figures (``OwnStats``) and its automatic
epochs (``AutoEpochs``).

A ``StreamingDataset``'s own figures, ``stats()["dataset"]``: what this dataset object's
consumers (this process and its DataLoader workers) did since it was made, apart from the node
cache's counters, which every process and dataset sharing the cache add to since the cache was
created or reset.

Shared memory (DataLoader workers inherit it, fork or spawn) holds one row of integer counters per
consumer (0: the main process, 1 + worker id), each added to only by that consumer's process: a
consumer adds its figures at the end of each of its epochs; ``totals`` sums the rows. Workers
beyond ``SLOTS`` share rows (one at a time in practice: a rank's workers are few).

Thread safety: ``add`` from a process's iterating thread; ``totals`` from any thread.

Small helpers of ``StreamingDataset``: shared-memory ints and the calling DataLoader's batch size.

Automatic epochs of a ``StreamingDataset`` whose ``set_epoch`` is never called: each new
``iter()`` reads the next epoch (the first: 0, or a loaded state's), as MosaicML Streaming does.

Every consumer of a rank (the main process, or each DataLoader worker, forked or spawned anew
each epoch or persistent) decides the epoch of a new iteration on its own, and all of them must
decide the same one, with no barrier. Shared memory, inherited by the workers, holds a flag
(``set_epoch`` was called: no automatic epochs) and one slot per consumer: the iteration token
and the epoch it last began, packed into one int64, so that a slot is written by one aligned store
and never read torn. An iteration's token is the same in all of its workers and differs between
iterations (``worker_token``). A consumer that finds its token in a slot takes that slot's epoch;
else it takes one more than the highest epoch in the slots (none: the base epoch). While the
workers of one iteration begin, a slot only changes from an older iteration's epoch to this
iteration's, so whichever of them a worker reads it computes the same epoch.

Thread safety: ``begin`` is called by the iterating thread of each process; ``set_explicit`` and
``clear`` by the training loop before an iteration.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["AutoEpochs", "OwnStats", "STORE_FIELDS", "shared_int", "worker_token"]

SLOTS = 64
FIELDS = ("samples", "remote_bytes", "requests", "retries", "skipped_shards", "wait_us")
STORE_FIELDS = {"remote_bytes": "bytes_read", "requests": "requests", "retries": "retries"}  # ours: the Store's


class OwnStats:
    """The dataset's own counters (see the module docstring)."""

    def __init__(self) -> None:
        self._shared: torch.Tensor = shared_int(SLOTS * len(FIELDS))
        self._view = self._shared.numpy().reshape(SLOTS, len(FIELDS))

    def __getstate__(self) -> dict[str, Any]:
        return {"_shared": self._shared}  # the tensor travels in shared memory; the view is rebuilt

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._shared = state["_shared"]
        self._view = self._shared.numpy().reshape(SLOTS, len(FIELDS))

    def add(self, slot: int, **deltas: float) -> None:
        """Add ``deltas`` (``FIELDS``; ``wait_seconds`` too) to the row of consumer ``slot``."""
        row = self._view[slot % SLOTS]
        for name, value in deltas.items():
            if name == "wait_seconds":
                name, value = "wait_us", value * 1e6
            row[FIELDS.index(name)] += int(value)

    def totals(self, **live: float) -> dict[str, Any]:
        """Every row summed, plus ``live`` (this process's figures not added yet), with
        ``wait_seconds`` in seconds."""
        sums = self._view.sum(axis=0)
        out: dict[str, Any] = {name: int(sums[i]) for i, name in enumerate(FIELDS) if name != "wait_us"}
        out["wait_seconds"] = float(sums[FIELDS.index("wait_us")]) / 1e6
        for name, value in live.items():
            out[name] += value
        return out


def shared_int(size: int | None = None) -> torch.Tensor:
    """A 0-d int64 tensor (``size``: a vector of that many) in shared memory: DataLoader workers
    (fork or spawn) share it with the main process, so a value set there later is seen by
    persistent workers."""
    t = torch.zeros(() if size is None else (size,), dtype=torch.int64)
    try:
        return t.share_memory_()
    except (RuntimeError, OSError):  # no shared memory: persistent workers will not see set_epoch
        return t


SLOTS = 64  # consumers of a rank with slots of their own (workers beyond share: the same token, the same epoch)
_EPOCH_BITS = 24
_EPOCH_MASK = (1 << _EPOCH_BITS) - 1
_TOKEN_MASK = (1 << 38) - 1


def worker_token(base_seed: int, iterations: int) -> int:
    """The token of a DataLoader worker's iteration: torch's per-iterator base seed (the same in
    every worker of one iteration, new for each iteration of non-persistent workers) and the
    worker's count of iterations of this dataset (persistent workers keep their base seed and
    count their iterations alike)."""
    return hash((int(base_seed), int(iterations))) & _TOKEN_MASK or 1


def main_token() -> int:
    """A fresh token for an iteration decided in the main process."""
    return random.getrandbits(38) or 1


class AutoEpochs:
    """The rank's shared epoch decisions (see the module docstring)."""

    def __init__(self) -> None:
        self._shared: torch.Tensor = shared_int(1 + SLOTS)
        self._view = self._shared.numpy()

    def __getstate__(self) -> dict[str, Any]:
        return {"_shared": self._shared}  # the tensor travels in shared memory; the view is rebuilt

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._shared = state["_shared"]
        self._view = self._shared.numpy()

    @property
    def explicit(self) -> bool:
        """``set_epoch`` was called (in any process of the rank): epochs are the caller's."""
        return bool(self._view[0])

    def set_explicit(self) -> None:
        self._view[0] = 1

    def clear(self) -> None:
        """Forget the iterations begun (a state was loaded: the next begins at its epoch)."""
        self._view[1:] = 0

    def begin(self, token: int, slot: int, base: int, fixed: int | None = None, inherited: bool = False) -> int:
        """The epoch of the iteration ``token`` that the consumer in ``slot`` (0: the main process,
        1 + worker id) begins: ``fixed`` when given (a loaded state's), else as the module says
        (``base`` when no iteration was begun); recorded in the slot. ``inherited``: ``fixed`` is a
        state the main process loaded (``clear``) and a DataLoader worker inherited, which only
        the first iteration after the load resumes (the slots still empty, or holding its token)."""
        seen = [int(v) for v in self._view[1:]]  # each an aligned 8-byte load
        mine = [(v & _EPOCH_MASK) - 1 for v in seen if v >> _EPOCH_BITS == token]
        epochs = [(v & _EPOCH_MASK) - 1 for v in seen if v]
        if fixed is not None and not (inherited and epochs):
            epoch = fixed
        else:
            epoch = mine[0] if mine else max(epochs) + 1 if epochs else base
        if not 0 <= epoch < _EPOCH_MASK:
            raise ValueError(f"datacache: epoch {epoch} outside [0, {_EPOCH_MASK - 1}]")
        self._view[1 + slot % SLOTS] = np.int64(token << _EPOCH_BITS | (epoch + 1))
        return epoch
