"""A ``StreamingDataset``'s own figures, ``stats()["dataset"]``: what this dataset object's
consumers (this process and its DataLoader workers) did since it was made, apart from the node
cache's counters, which every process and dataset sharing the cache add to since the cache was
created or reset.

Shared memory (DataLoader workers inherit it, fork or spawn) holds one row of integer counters per
consumer (0: the main process, 1 + worker id), each added to only by that consumer's process: a
consumer adds its figures at the end of each of its epochs; ``totals`` sums the rows. Workers
beyond ``SLOTS`` share rows (one at a time in practice: a rank's workers are few).

Thread safety: ``add`` from a process's iterating thread; ``totals`` from any thread.
"""
from __future__ import annotations

from typing import Any

import torch

from ._dsutil import shared_int

__all__ = ["STORE_FIELDS", "OwnStats"]

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
