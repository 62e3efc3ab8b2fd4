"""A forked DataLoader worker inherits the training process's heap frozen for the garbage
collector (``datacache.read.lifecycle``): its first full collection walks only what the worker made, so
it neither spends a cold epoch's first 0.2 s on the parent's objects nor copies their pages. The
parent's collector is untouched, and a parent that freezes objects itself keeps them frozen."""
from __future__ import annotations

import gc
import os
from typing import Any, Iterator

import numpy as np
import pytest
import torch.utils.data as tud

from datacache import NodeCache, StreamingDataset, write_dataset

pytestmark = pytest.mark.timeout(120)


def _in_child(report: Any) -> int:
    """Fork; the child writes ``report()`` to a pipe and exits; returns what it wrote."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(w, str(int(report())).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        os.waitpid(pid, 0)
        return int(os.read(r, 64).decode())
    finally:
        os.close(r)


def test_a_forked_child_starts_with_the_heap_frozen_and_the_parent_does_not() -> None:
    import datacache.pytorch.dataset  # noqa: F401 - registers the fork hook, as any StreamingDataset does

    assert gc.get_freeze_count() == 0
    keep = [[i] for i in range(10_000)]  # objects the child inherits
    frozen = _in_child(gc.get_freeze_count)
    assert frozen >= len(keep), f"the child's permanent generation holds {frozen} objects"
    assert gc.get_freeze_count() == 0, "the parent's objects stay in its own generations"
    cycle: list[Any] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1, "the parent still collects what it made before the fork"


def test_a_parent_that_froze_its_heap_keeps_it_frozen() -> None:
    import datacache.pytorch.dataset  # noqa: F401

    gc.freeze()
    try:
        before = gc.get_freeze_count()
        assert _in_child(gc.get_freeze_count) > 0.9 * before  # the child frees a few of them
        # == 0 had the hook thawed them; a few frozen objects may be freed meanwhile (other threads)
        assert gc.get_freeze_count() > 0.9 * before, "the hook thawed objects the parent had frozen"
    finally:
        gc.unfreeze()


class _FreezeCounts(tud.IterableDataset):
    def __iter__(self) -> Iterator[int]:
        yield gc.get_freeze_count()


def test_dataloader_workers_start_frozen(tmp_path: Any, cache: NodeCache) -> None:
    url = f"file://{tmp_path}/ds"
    write_dataset(({"i": i, "x": np.zeros(4, np.int32)} for i in range(64)), url, shard_bytes=512, progress=False)
    ds = StreamingDataset(url, cache=cache)  # the training process as a user has it
    counts = list(tud.DataLoader(_FreezeCounts(), batch_size=None, num_workers=2))
    ds.close()
    assert len(counts) == 2 and all(c > 10_000 for c in counts), counts
    assert gc.get_freeze_count() == 0
