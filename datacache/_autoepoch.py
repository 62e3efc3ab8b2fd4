"""Automatic epochs of a ``StreamingDataset`` whose ``set_epoch`` is never called: each new
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

from ._dsutil import shared_int

__all__ = ["AutoEpochs", "worker_token"]

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
