"""``datacache.read.headstart``: the training process fetches its DataLoader workers' first shards
while they start. Counted in the node cache and at the proxy, never timed."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.utils.data as tud

import datacache
from datacache import StreamingDataset
from datacache.read.headstart import RUNS_PER_WORKER, HeadStart, first_chunks
from tests.helpers import faults as H

pytestmark = pytest.mark.timeout(180)


def _dataset(url: str, opts: dict[str, Any], tmp_path: Path, **kw: Any) -> StreamingDataset:
    """The window's epoch (``node_shuffle="never"``): its workers' first shards are what a head start
    and the lead get (a part mix reads parts of every shard from the start: tests/test_node_mix.py)."""
    kw.setdefault("node_shuffle", "never")
    return StreamingDataset(url, storage_options=opts, seed=3, cache=H.cache_config(tmp_path, ram="8MB"), **kw)


def test_it_fetches_each_workers_first_runs_then_the_epoch_fetches_the_rest_once(
        s3_server: Any, make_s3_url: Any, tmp_path: Path) -> None:
    n, size, per_shard = 480, 2000, 16  # 30 shards
    url = make_s3_url()
    H.write(url, s3_server.storage_options(), n, size, shard_bytes=per_shard * size)
    ds = _dataset(url, s3_server.storage_options(), tmp_path)
    head = ds.head_start(2)
    assert head is not None and head.wait(120)
    assert len(head.shards) == 2 * RUNS_PER_WORKER
    fetched = ds.cache.stats()["fetches"]
    assert fetched == len(set(head.shards)), f"the head start fetched {fetched} shards"
    ids = H.assert_exactly_once(tud.DataLoader(ds, batch_size=None, num_workers=2), n, size)
    assert len(ids) == n
    # the workers found the head start's shards in the cache: every shard downloaded exactly once
    assert ds.cache.stats()["fetches"] == n // per_shard
    head.close()
    head.close()  # idempotent
    ds.close()


def test_none_while_a_resume_is_pending(small_dataset: Any, tmp_path: Path) -> None:
    url, opts, _ = small_dataset
    ds = _dataset(url, opts, tmp_path, batch_size=4)
    loader = datacache.DataLoader(ds, num_workers=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it, loader
    ds.close()
    ds = _dataset(url, opts, tmp_path, batch_size=4)
    ds.load_state_dict(state)
    assert ds.head_start(2) is None  # the workers start mid-plan: theirs are not the first shards
    ds.close()


def test_close_abandons_the_download_in_flight_and_leaves_the_cache_whole(
        s3_server: Any, make_s3_url: Any, slowlink: Any, tmp_path: Path) -> None:
    n, size = 64, 4000  # 2 shards of 128 KB behind a 20 KB/s link: seconds each
    url = make_s3_url()
    m = H.write(url, s3_server.storage_options(), n, size, shard_bytes=32 * size)
    link = slowlink(bandwidth=20_000)
    ds = _dataset(url, s3_server.storage_options(link.endpoint_url), tmp_path)
    head = HeadStart(ds.source, [(0, 0.0), (1, 0.0)], name="test-headstart")
    head.close()  # returns: the read in flight is cancelled, the next never starts
    assert head.done
    assert ds.cache.stats()["fetches"] <= 1
    assert not H.leftovers(tmp_path / "ram"), "a cancelled download left a temporary file"
    fast = _dataset(url, s3_server.storage_options(), tmp_path)  # the same cache, no slow link
    assert H.assert_exactly_once(fast, n, size) and len(m.shards) == 2
    fast.close()
    ds.close()


def test_a_full_cache_gets_no_head_start(s3_server: Any, make_s3_url: Any, tmp_path: Path) -> None:
    """With the cache full of the last epoch's shards, an eviction now (before the workers tell the
    cache this epoch's plan) could throw out a shard the epoch needs: the head start fetches nothing."""
    n, size, per_shard = 480, 2000, 16  # 30 shards of 32 KB through a cache of 8
    url = make_s3_url()
    H.write(url, s3_server.storage_options(), n, size, shard_bytes=per_shard * size)
    ds = StreamingDataset(url, storage_options=s3_server.storage_options(), seed=3,
                          cache=H.cache_config(tmp_path, ram=8 * per_shard * size + 1000))
    H.assert_exactly_once(ds, n, size)  # epoch 0 fills the cache
    ds.set_epoch(1)
    before = ds.cache.stats()["fetches"]
    head = ds.head_start(2)
    assert head is not None and head.wait(120)
    assert ds.cache.stats()["fetches"] == before
    assert any(not ds.cache.contains(ds.source.key(s)) for s in head.shards), "all were cached: nothing tested"
    ds.close()


def test_the_workers_first_shards_cross_the_link_one_after_another(
        s3_server: Any, make_s3_url: Any, slowlink: Any, tmp_path: Path) -> None:
    """``PrefetchConfig.slow_start`` with the workers' lead (``Consumer``'s ``lead``): worker 1
    starts its first shard only once worker 0's is in, and neither starts its lookahead before, so
    when the first sample (worker 0's) arrives about one shard has crossed the link, where without
    the lead two shards would have shared it (and four without slow start). A plain torch
    DataLoader: no head start. Counted at the proxy; a shard takes 2 s on this link, so only a first
    sample delivered 1.5 s after its shard landed could blur the count."""
    n, size, per_shard = 160, 4000, 40  # 4 shards of 160 KB, 2 per worker
    url = make_s3_url()
    m = H.write(url, s3_server.storage_options(), n, size, shard_bytes=per_shard * size)
    link = slowlink(bandwidth=80_000)
    ds = _dataset(url, s3_server.storage_options(link.endpoint_url), tmp_path)
    shard = max(s.bytes for s in m.shards)
    link.reset_counters()
    it = iter(tud.DataLoader(ds, batch_size=None, num_workers=2))
    next(it)
    down = link.snapshot()["bytes_down"]
    assert shard <= down < 1.75 * shard, f"{down / shard:.2f} shards crossed the link before the first sample"
    del it
    ds.close()


def test_a_part_mixed_epoch_gets_its_workers_first_chunks_rows_then_every_block_once(
        s3_server: Any, make_s3_url: Any, tmp_path: Path) -> None:
    """A cold part mix (``datacache.plan.part_shuffle``): the head start loads the rows of each worker's
    first chunks into the shards' partial copies (ranged reads, no whole shard), and the workers
    then read every block once more at most (single flight across the processes)."""
    n, size, per_shard = 960, 1000, 96  # 10 shards of about 24 blocks of 4 samples
    url = make_s3_url()
    H.write(url, s3_server.storage_options(), n, size, shard_bytes=per_shard * size,
            writer_options={"block_bytes": 4 * 1024})
    ds = _dataset(url, s3_server.storage_options(), tmp_path, node_shuffle="auto")
    read_before = ds.source.store.stats()["bytes_read"]  # the manifest's
    head = ds.head_start(2)
    assert head is not None and head.wait(120)
    got = ds.cache.stats()
    # ranged reads only (a copy whose every block came in is cached whole: counted as a fetch)
    assert ds.source.store.stats()["bytes_read"] - read_before == got["partial_bytes"], got
    # the first chunks' blocks (96 of 960 samples per worker) and each shard's index: not the dataset
    assert 0 < got["partial_bytes"] < 0.75 * ds.manifest.total_bytes, got
    assert len(set(head.shards)) > 2  # the first chunks draw on many shards
    ids = H.assert_exactly_once(tud.DataLoader(ds, batch_size=None, num_workers=2), n, size)
    assert len(ids) == n
    stats, total = ds.cache.stats(), ds.manifest.total_bytes
    assert stats["remote_bytes"] == total and total <= stats["partial_bytes"] <= 1.05 * total, stats
    head.close()
    head.close()  # idempotent
    ds.close()


def test_a_head_start_planned_before_the_fork_fetches_only_once_started(
        s3_server: Any, make_s3_url: Any, tmp_path: Path) -> None:
    """``head_start(start=False)`` (``datacache.DataLoader`` plans it before its workers fork, so
    that they inherit the plans): nothing is read until ``start()``; closed unstarted, it ends."""
    n, size, per_shard = 960, 1000, 96
    url = make_s3_url()
    H.write(url, s3_server.storage_options(), n, size, shard_bytes=per_shard * size,
            writer_options={"block_bytes": 4 * 1024})
    ds = _dataset(url, s3_server.storage_options(), tmp_path, node_shuffle="auto", batch_size=8)
    read_before = ds.source.store.stats()["bytes_read"]
    unused = ds.head_start(2, start=False)
    assert unused is not None
    unused.close()
    unused.start()  # a closed head start starts no thread
    head = ds.head_start(2, start=False)
    assert head is not None and ds.source.store.stats()["bytes_read"] == read_before, "planned, nothing read"
    head.start()
    assert head.wait(120) and ds.cache.stats()["partial_bytes"] > 0
    head.close()
    assert unused.done
    ds.close()


@pytest.mark.parametrize("slow_start", [True, False])
def test_a_part_mixed_epochs_first_sample_waits_for_worker_0s_first_chunk_alone(
        s3_server: Any, make_s3_url: Any, slowlink: Any, tmp_path: Path, slow_start: bool) -> None:
    """The lead of a part mix (``datacache.read.headstart.Lead``): worker 1 loads worker 0's first-chunk runs
    before its own, and worker 0 its lookahead only once its first chunk and then worker 1's are
    in, so when the first sample (worker 0's) arrives, the link has carried worker 0's first chunk
    (its shards' indexes and heads, and its blocks) and little more. Without it
    (``slow_start=False``) both workers' first chunks and lookaheads share the link. Counted at
    the proxy; a plain torch DataLoader (no head start)."""
    n, size, per_shard = 960, 1000, 96  # 10 shards of about 24 blocks of 4 samples
    url = make_s3_url()
    H.write(url, s3_server.storage_options(), n, size, shard_bytes=per_shard * size,
            writer_options={"block_bytes": 4 * 1024})
    link = slowlink(bandwidth=200_000)
    ds = _dataset(url, s3_server.storage_options(link.endpoint_url), tmp_path, node_shuffle="auto",
                  prefetch=datacache.PrefetchConfig(slow_start=slow_start))
    firsts = [first_chunks(ds._worker_plan(2, w, None, 0, shards_only=True)[0], 0, 1) for w in range(2)]
    shards = [{shard for _, shard, _, _ in f} for f in firsts]
    blocks = [{(shard, row // 4) for _, shard, _, rows in f for row in rows} for f in firsts]
    # at most: each shard's index and head (20 KiB), each block (4 samples of 1000 B and framing)
    first = len(shards[0]) * 20 * 1024 + len(blocks[0]) * 4608
    second = len(shards[1] - shards[0]) * 20 * 1024 + len(blocks[1] - blocks[0]) * 4608
    link.reset_counters()
    it = iter(tud.DataLoader(ds, batch_size=None, num_workers=2))
    next(it)
    down = link.snapshot()["bytes_down"]
    del it
    ds.close()
    if slow_start:
        assert down <= first + second / 2, \
            f"{down} B crossed before the first sample; worker 0's first chunk is {first} B"
    else:
        assert down > first + second, f"{down} B crossed before the first sample without the lead"
