"""Batches carried in bundles from DataLoader workers (``datacache.pytorch.bundles``): handed out in
the order torch gives one batch per item, errors at their place, fewer items than batches."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader

import datacache
from datacache import NodeCache, StreamingDataset
from datacache.pytorch.bundles import Bundle, Deferred, Unbundler, bundled

N = 500
pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]


def torch_items(workers: list[Iterator[Bundle]]) -> Iterator[Bundle | Exception]:
    """Items in torch's in-order turns: each worker in turn, skipping one whose iterator has ended;
    a worker's error takes the place of its item and ends it."""
    live = list(range(len(workers)))
    while live:
        for w in list(live):
            try:
                yield next(workers[w])
            except StopIteration:
                live.remove(w)
            except Exception as exc:  # noqa: BLE001 - what torch re-raises in the training process
                live.remove(w)
                yield exc


def torch_step(workers: list[Iterator[Bundle]]) -> Callable[[], Any]:
    """``next()`` on a torch loader over these workers: their items in turn, their errors raised."""
    items = torch_items(workers)

    def step() -> Any:
        item = next(items)
        if isinstance(item, Exception):
            raise item
        return item
    return step


def unbundled(workers: list[Iterator[Bundle]]) -> Iterator[Any]:
    take = Unbundler(torch_step(workers), len(workers))
    while True:
        try:
            yield take()
        except StopIteration:
            return


def one_by_one(counts: list[int]) -> list[tuple[int, int]]:
    """(worker, batch) in torch's turns with one batch per item."""
    out, left = [], list(counts)
    for j in itertools.count():
        if not any(c > j for c in counts):
            return out
        out += [(w, j) for w in range(len(counts)) if left[w] > j]


@pytest.mark.parametrize("counts", [[5, 3], [7, 7, 6], [0, 4], [4, 0, 9, 1], [0, 0], [1], [12, 2, 30]])
def test_bundles_come_out_in_the_order_of_one_batch_per_item(counts: list[int]) -> None:
    workers = [bundled([(w, j) for j in range(c)], w, size=4) for w, c in enumerate(counts)]
    assert list(unbundled(workers)) == one_by_one(counts)


def test_bundles_grow_to_their_size_and_the_last_says_so() -> None:
    got = list(bundled(range(12), worker=1, size=4, defer=False))
    assert [b.batches for b in got] == [[0], [1, 2], [3, 4, 5, 6], [7, 8, 9, 10], [11]]
    assert [b.last for b in got] == [False] * 4 + [True] and {b.worker for b in got} == {1}
    assert [b.batches for b in bundled(range(3), 0, 4)][-1] == [], "ended on a bundle's edge: an empty last one"


def test_batches_without_tensors_cross_pickled_and_are_unpickled_when_handed_out() -> None:
    """A ring batch's bytes values are made when it is handed out, not when its bundle arrives;
    a batch holding a tensor (its storage crosses by descriptor) goes as it is."""
    tensor_batch = {"x": torch.arange(3), "meta": [b"a"]}
    plain_batch = {"x": [b"a", b"bc"], "n": (1, 2)}
    (bundle,) = list(bundled([plain_batch], 0, 4))[:1]
    (deferred,) = bundle.batches
    assert isinstance(deferred, Deferred) and deferred.load() == plain_batch
    (bundle,) = list(bundled([tensor_batch], 0, 4))[:1]
    assert bundle.batches == [tensor_batch]
    pending = [bundled([plain_batch, plain_batch, plain_batch], 0, 4)]
    assert list(unbundled(pending)) == [plain_batch] * 3


def test_a_workers_error_comes_after_its_batches_made_before_it() -> None:
    def failing(w: int, count: int, fail_at: int) -> Iterator[tuple[int, int]]:
        for j in range(count):
            if j == fail_at:
                raise ValueError(f"worker {w} batch {j}")
            yield (w, j)

    counts = [9, 9, 9]
    workers = [bundled(failing(w, 9, 5 if w == 1 else 99), w, size=4) for w in range(3)]
    got: list[tuple[int, int]] = []
    with pytest.raises(ValueError, match="worker 1 batch 5"):
        for b in unbundled(workers):
            got.append(b)
    expected = one_by_one(counts)
    assert got == expected[:expected.index((1, 5))], "every batch before the error, in order, and none after"


def test_after_a_workers_error_the_others_batches_follow() -> None:
    """As torch's loader: the iteration goes on past a worker's error with the other workers."""
    def failing() -> Iterator[int]:
        yield 0
        raise ValueError("worker 0")

    workers = [bundled(failing(), 0, size=4), bundled(list(range(10, 19)), 1, size=4)]
    take, got = Unbundler(torch_step(workers), 2), []
    for _ in range(12):
        try:
            got.append(take())
        except ValueError:
            got.append("error")
        except StopIteration:
            break
    assert got == [0, 10, "error", *range(11, 19)]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    u = f"file://{tmp_path_factory.mktemp('bundles')}/ds"
    datacache.write_dataset(({"i": i, "x": np.full(4, i, np.int32)} for i in range(N)), u, shard_bytes=3000,
                            progress=False)
    return u


@pytest.mark.parametrize("workers", [2, 3])
def test_the_loader_gives_torchs_batch_order_with_fewer_items(url: str, cache: NodeCache, workers: int) -> None:
    """The batches of datacache.DataLoader (bundled) are those torch's DataLoader takes one per item
    from the same dataset in batched mode, in the same order; the workers sent fewer items."""
    plain = StreamingDataset(url, cache=cache, seed=9, batch_size=16)
    plain.set_epoch(1)
    expected = [b["i"].tolist() for b in TorchDataLoader(plain, batch_size=None, num_workers=workers)]
    plain.close()
    ds = StreamingDataset(url, cache=cache, seed=9)
    ds.set_epoch(1)
    it = iter(datacache.DataLoader(ds, batch_size=16, num_workers=workers))
    got = [b["i"].tolist() for b in it]
    items = it._it._num_yielded  # torch's count of the items its workers handed over
    del it
    ds.close()
    assert got == expected
    assert sorted(i for b in got for i in b) == list(range(N))
    assert items < len(got), f"{items} items for {len(got)} batches: the workers did not bundle"


def test_a_plain_torch_loader_over_the_same_dataset_gets_batches(url: str, cache: NodeCache) -> None:
    """Only the workers datacache.DataLoader forks send bundles: the dataset it configured, read
    by torch's own DataLoader afterwards, yields batches."""
    ds = StreamingDataset(url, cache=cache, seed=2)
    first = [b["i"].tolist() for b in datacache.DataLoader(ds, batch_size=16, num_workers=2)]
    again = [b["i"].tolist() for b in TorchDataLoader(ds, batch_size=None, num_workers=2)]
    ds.close()
    assert all(len(b) <= 16 for b in again) and len(again) == len(first)
    assert sorted(i for b in again for i in b) == sorted(i for b in first for i in b) == list(range(N))
