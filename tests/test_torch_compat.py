"""The torch internals datacache relies on (datacache.pytorch.torch_compat) are still what it expects:
a torch that changes them fails here, loudly, not in a user's job. No server, no worker process."""
from __future__ import annotations

import inspect
import sys
from typing import Any

import torch.utils.data as tud
from torch.utils.data._utils.fetch import _BaseDatasetFetcher, _IterableDatasetFetcher

from datacache.pytorch.torch_compat import batch_step, loader_batch


class _Probe(tud.IterableDataset):
    """Yields 10 ints and records what loader_batch sees from its __iter__."""

    def __init__(self) -> None:
        self.seen: list[int | None] = []

    def __iter__(self) -> Any:
        for i in range(10):
            self.seen.append(loader_batch(sys._getframe().f_back))
            yield i


def test_the_fetcher_that_resumes_an_iterable_dataset_is_what_loader_batch_reads() -> None:
    assert issubclass(_IterableDatasetFetcher, _BaseDatasetFetcher)
    assert "possibly_batched_index" in inspect.signature(_IterableDatasetFetcher.fetch).parameters
    assert "auto_collation" in inspect.signature(_BaseDatasetFetcher.__init__).parameters


def test_loader_batch_tells_a_batching_loader_from_any_other_caller() -> None:
    ds = _Probe()
    assert [b.tolist() for b in tud.DataLoader(ds, batch_size=4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert set(ds.seen[:8]) == {4}, ds.seen  # torch's fetcher asked for batches of 4
    ds.seen.clear()
    assert len(list(tud.DataLoader(ds, batch_size=None))) == 10
    assert set(ds.seen) == {None}, ds.seen  # no auto-collation: the dataset batches, or nobody does
    ds.seen.clear()
    assert list(ds) == list(range(10)) and set(ds.seen) == {None}  # a plain loop is no DataLoader


def test_batch_step_skips_only_the_profiler_range_of_torchs_iterator() -> None:
    it = iter(tud.DataLoader(list(range(6)), batch_size=2))
    for attr in ("_next_data", "_sampler_iter", "_num_yielded"):
        assert hasattr(it, attr), f"torch's DataLoader iterator has no {attr}: update torch_compat.batch_step"
    step = batch_step(it)
    assert step != it.__next__, "batch_step fell back to __next__ on this torch"
    assert step().tolist() == [0, 1]  # the first call starts the epoch through torch's own __next__
    assert step().tolist() == [2, 3] and step().tolist() == [4, 5]
    assert it._num_yielded == 3

    class Other:
        def __next__(self) -> int:
            return 7
    assert batch_step(Other())() == 7  # another iterator: its own __next__
