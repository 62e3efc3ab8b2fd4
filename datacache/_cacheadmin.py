"""``NodeCache``'s reporting and housekeeping side: node-wide counters, entries, pins, free room,
and ``clear``. A part of ``NodeCache`` (``datacache.cache``) in its own module to keep each file
readable: ``CacheAdminMixin`` holds no state and uses only the attributes ``NodeCache.__init__``
sets (``index``, ``tiers``, ``lock_dir``). Every method is thread-safe and fork-safe, as
``NodeCache``'s are.
"""
from __future__ import annotations

import os
import shutil
import uuid
import weakref
from typing import Any

from .index import Entry, Index
from .tiers import Tier, key_id, pinned_files
from ._reconcile import clear

__all__ = ["CacheAdminMixin"]


class CacheAdminMixin:
    """Counters, entries, pins, room and ``clear`` of a ``NodeCache`` (see the module docstring)."""

    index: Index
    tiers: dict[str, Tier]
    lock_dir: str

    def stats(self) -> dict[str, Any]:
        """Node-wide counters (summed over every process sharing the index) and tier usage."""
        self.index.flush()
        with self.index.read() as txn:
            out: dict[str, Any] = {k: (v if k == "fetch_seconds" else int(v)) for k, v in txn.counters().items()}
            for name, tier in self.tiers.items():
                out[f"used_{name}"] = txn.used(name)
                out[f"budget_{name}"] = tier.budget if tier.enabled else 0
            out["entries_ram"] = out["entries_ssd"] = 0
            for _, e in txn.items():
                for name in e.tiers:
                    out[f"entries_{name}"] += 1
        return out

    def entries(self) -> list[tuple[str, Entry]]:
        """Every indexed entry as (key, entry). A snapshot; no pins are taken."""
        with self.index.read() as txn:
            return list(txn.items())

    def entry_files(self, prefix: str = "") -> list[tuple[str, Entry, str, str]]:
        """(key, entry, tier, file path) of every entry file whose key starts with ``prefix``. A
        snapshot: a file may be evicted at any time, so pin it (``tiers.try_pin``) before reading."""
        return [(key, e, tier, self.tiers[tier].file_path(rec["file"]))
                for key, e in self.entries() if key.startswith(prefix) for tier, rec in e.tiers.items()]

    def pinned(self) -> dict[str, dict[str, int]] | None:
        """Entries pinned now per tier (``{"ram": {"entries", "bytes"}, "ssd": ...}``: held open by
        a reader, so not evictable), or None where pins cannot be seen (``tiers.pinned_files``)."""
        files = self.entry_files()
        held = pinned_files([path for *_, path in files])
        if held is None:
            return None
        pinned = set(held)
        out = {name: {"entries": 0, "bytes": 0} for name in self.tiers}
        for _, e, tier, path in files:
            if path in pinned:
                out[tier]["entries"] += 1
                out[tier]["bytes"] += e.size
        return out

    def room(self) -> dict[str, int]:
        """Free bytes each tier has now (its budget less what it holds; 0 for a disabled tier).
        Thread-safe; one index read."""
        with self.index.read() as txn:
            return {name: max(0, b - txn.used(name)) for name, b in self.budgets().items()}

    def budgets(self) -> dict[str, int]:
        """Bytes each tier may hold now ("ram", "ssd"; 0 for a disabled tier). Thread-safe."""
        return {name: (t.budget if t.enabled else 0) for name, t in self.tiers.items()}

    def reading(self, owner: object, datasets: frozenset[str]) -> None:
        """Note that ``owner`` (a dataset object) reads ``datasets`` through this cache in this
        process, until it is garbage (``others_reading``: the node mix's and part mix's decisions
        count it as a competing dataset before it has told the cache its plan). Thread-safe."""
        token = id(owner)
        self.open_datasets[token] = datasets  # type: ignore[attr-defined]
        weakref.finalize(owner, self.open_datasets.pop, token, None)  # type: ignore[attr-defined]

    def others_reading(self, datasets: frozenset[str]) -> bool:
        """Whether this process reads a dataset other than ``datasets`` through this cache."""
        return any(d - datasets for d in list(self.open_datasets.values()))  # type: ignore[attr-defined]

    def scratch_path(self, key: str, size: int) -> str | None:
        """Where a node-wide scratch copy of ``key`` may be filled (``datacache._partial``): in the
        first enabled tier whose budget holds ``size`` bytes beside its entries and the scratch
        copies in it now, and whose file system has twice that free; else None (the caller fetches
        the whole shard). The name is new each call (``.tmp-<key id>.<generation>.part``), so a
        stale state can never name a newer copy's file; it starts with ``.tmp-``: reconciliation
        removes a leftover one."""
        with self.index.read() as txn:
            used = {name: txn.used(name) for name in self.tiers}
        for name, tier in self.tiers.items():
            if not tier.enabled:
                continue
            try:
                scratch = sum(_size(e) for e in tier.scan() if e.name.endswith(".part") and e.name.startswith(".tmp-"))
                free = shutil.disk_usage(tier.data_dir).free
            except OSError:
                continue
            if used[name] + scratch + size <= tier.budget and free >= 2 * size:
                return f"{tier.temp_path(key_id(key))}.{uuid.uuid4().hex[:12]}.part"
        return None

    def scratch_files(self, key: str) -> list[str]:
        """The paths of every scratch copy of ``key`` in the tiers now (``scratch_path``'s names)."""
        prefix = os.path.basename(next(iter(self.tiers.values())).temp_path(key_id(key))) + "."
        return [e.path for tier in self.tiers.values() for e in tier.scan()
                if e.name.startswith(prefix) and e.name.endswith(".part")]

    def count(self, **deltas: float) -> None:
        """Add to the node-wide counters of ``stats()`` (e.g. ``wait_seconds``, ``skipped_shards``);
        written at the next index transaction or ``flush_stats``. Thread-safe, no I/O."""
        self.index.count(**deltas)

    def flush_stats(self) -> None:
        """Write this process's pending counter deltas now."""
        self.index.flush()

    def clear(self, *, tiers: tuple[str, ...] = ("ram", "ssd"), dataset: str | None = None) -> int:
        """Remove unpinned entries (optionally only one dataset's); returns how many files went."""
        return clear(self.index, self.tiers, self.lock_dir, tiers, dataset)

    def reset_stats(self) -> None:
        with self.index.write() as txn:
            txn.reset_counters()


def _size(entry: Any) -> int:
    try:  # other processes' scratch copies come and go while we look
        return int(entry.stat(follow_symlinks=False).st_size)
    except FileNotFoundError:
        return 0
