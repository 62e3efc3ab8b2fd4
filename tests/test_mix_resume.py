"""Resuming a mixed StreamingDataset in epoch 2 (repeats and a new subset drawn): the exact order
at several midpoints, through StatefulDataLoader workers, and with another world size / worker
count with exact counts, for every batching mode. Driven by tests.helpers.resume."""
from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

import datacache
from datacache import NodeCache, StreamingDataset
from tests.helpers.mix import EPOCH, B, check_epoch, stream_of, streams, write_streams
from tests.helpers.resume import Stage, _ids, check_exactly_once, check_resume


@pytest.fixture(scope="module")
def stream_urls(s3_server: Any) -> list[str]:
    return write_streams(s3_server)


MODES = [("random", None), ("random", B), ("stratified", B), ("per_stream", B)]


def factory(urls: list[str], opts: dict[str, Any], cache: NodeCache, batching: str, batch_size: int | None):
    def make_ds(dp_rank: int = 0, dp_size: int = 1) -> StreamingDataset:
        return StreamingDataset(streams=streams(urls, opts), epoch_size=EPOCH, batch_size=batch_size,
                                batching=batching, cache=cache, seed=9, dp_rank=dp_rank, dp_size=dp_size)
    return make_ds


def stateful(workers: int, batch: int | None):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return lambda ds: StatefulDataLoader(ds, num_workers=workers, batch_size=None if batch else 4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batching, batch_size", MODES)
def test_resume_epoch_two_exact_order(stream_urls: list[str], s3_storage_options: dict[str, Any],
                                      cache: NodeCache, batching: str, batch_size: int | None) -> None:
    make = factory(stream_urls, s3_storage_options, cache, batching, batch_size)
    n = EPOCH if batch_size is None else len(make())
    ref = check_resume(make, [1, n // 2 + 1, n - 1, (n // 4, n // 4)], epoch=2)  # first, middle, last, twice
    check_epoch([i for item in ref for i in (item if isinstance(item, tuple) else (item,))])
    # through StatefulDataLoader with 2 workers (its state holds each worker's count)
    check_resume(make, [(2, 3)], epoch=2, make_loader=stateful(2, batch_size))
    # through datacache.DataLoader with 3 workers (its state counted from the batches handed out)
    check_resume(make, [(2, 3), n - 1], epoch=2,
                 make_loader=lambda ds: datacache.DataLoader(ds, batch_size=None, num_workers=3))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batching, batch_size", MODES)
def test_resume_epoch_two_other_world_exact_counts(stream_urls: list[str], s3_storage_options: dict[str, Any],
                                                   cache: NodeCache, batching: str, batch_size: int | None) -> None:
    make = factory(stream_urls, s3_storage_options, cache, batching, batch_size)
    ref = make()
    ref.set_epoch(2)
    expected = Counter(i for item in ref for i in _ids(item))
    ref.close()
    check_epoch(list(expected.elements()))
    loader_batch = None if batch_size else 4
    # 2 ranks x 2 StatefulDataLoader workers save mid-epoch 2 -> 3 ranks, 1 worker -> 1 rank, 2 workers
    stages = [Stage(2, num_workers=2, reads=3), Stage(3, num_workers=1, reads=2, load="all"),
              Stage(1, num_workers=2)]
    seen = check_exactly_once(make, stages, epoch=2, loader_batch=loader_batch, expected=expected)
    assert Counter(stream_of(i) for i in seen) == {s: c for s, c in
                                                   Counter(stream_of(i) for i in expected.elements()).items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batching", ["stratified", "per_stream"])
def test_resume_composed_mix_across_node_counts(stream_urls: list[str], s3_storage_options: dict[str, Any],
                                                cache: NodeCache, batching: str) -> None:
    """A composed mix is laid out per node (node-sticky): 4 ranks on 2 nodes x 2 StatefulDataLoader
    workers save mid-epoch 2 -> 3 ranks on 1 node -> 2 ranks on 2 nodes: exactly once, exact counts."""
    from datacache.dist import DistInfo

    per_node = {4: 2, 3: 3, 2: 1}

    def make(dp_rank: int = 0, dp_size: int = 1) -> StreamingDataset:
        lws = per_node.get(dp_size, dp_size)
        return StreamingDataset(streams=streams(stream_urls, s3_storage_options), epoch_size=EPOCH, batch_size=B,
                                batching=batching, cache=cache, seed=9,
                                dist=DistInfo(rank=dp_rank, world_size=dp_size, local_rank=dp_rank % lws,
                                              local_world_size=lws))
    ref = make(0, 4)
    assert ref.num_nodes == 2
    expected = Counter()
    for r in range(4):
        ds = make(r, 4)
        ds.set_epoch(2)
        expected.update(i for item in ds for i in _ids(item))
        ds.close()
    ref.close()
    check_epoch(list(expected.elements()))
    stages = [Stage(4, num_workers=2, reads=2), Stage(3, num_workers=1, reads=2, load="all"), Stage(2, num_workers=1)]
    check_exactly_once(make, stages, epoch=2, loader_batch=None, expected=expected)
