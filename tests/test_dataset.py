"""StreamingDataset end to end, over file:// and the SeaweedFS S3 fixture: DataLoader modes, epochs,
batching, transforms, replication, errors from the fetch path, lifecycle, stats; dist.detect."""
from __future__ import annotations

import gc
import threading
import traceback
import uuid
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from datacache import DatacacheError, NodeCache, NotFoundError, StreamingDataset, open_store, write_dataset
from datacache.dist import DistInfo, detect

N = 240


def _samples(n: int = N):
    return ({"i": i, "x": np.full(4, i, dtype=np.int32)} for i in range(n))


@pytest.fixture(scope="module", params=["file", "s3"])
def location(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """(url, storage_options) of a 240-sample dataset in ~10 shards on each backend."""
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        url, opts = f"s3://{server.bucket}/{uuid.uuid4().hex}/", server.storage_options()
    else:
        url, opts = f"file://{tmp_path_factory.mktemp('dataset')}/ds", None
    m = write_dataset(_samples(), url, shard_bytes=1200, storage_options=opts, progress=False)
    assert 6 <= len(m.shards) <= 16
    return url, opts


def make(location: tuple[str, Any], cache: NodeCache, **kw: Any) -> StreamingDataset:
    url, opts = location
    return StreamingDataset(url, storage_options=opts, cache=cache, **kw)


def ids_of(batches: Any) -> list[int]:
    out: list[int] = []
    for b in batches:
        i = b["i"]
        assert np.array_equal(np.asarray(b["x"])[..., 0], np.asarray(i)), "fields misaligned"
        out += i.tolist() if isinstance(i, torch.Tensor) else [int(i)]
    return out


LOADERS = {
    "main": dict(num_workers=0),
    "workers2": dict(num_workers=2),
    "persistent": dict(num_workers=2, persistent_workers=True),
    "pin": dict(num_workers=2, pin_memory=True),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(LOADERS))
def test_dataloader_epochs_exactly_once(location: tuple[str, Any], cache: NodeCache, mode: str) -> None:
    if location[0].startswith("s3") and mode == "pin":
        pytest.skip("pin_memory is independent of the backend")
    ds = make(location, cache, seed=11)
    loader = DataLoader(ds, batch_size=10, **LOADERS[mode])
    orders = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        got = ids_of(loader)
        assert sorted(got) == list(range(N)), f"epoch {epoch}: not every sample exactly once"
        orders.append(got)
    assert orders[0] != orders[1], "set_epoch did not reshuffle"
    ds.set_epoch(0)
    assert ids_of(loader) == orders[0], "an epoch's order must be reproducible"
    del loader
    ds.close()


@pytest.mark.timeout(120)
def test_batched_mode_equal_batch_counts(location: tuple[str, Any], cache: NodeCache) -> None:
    if location[0].startswith("s3"):
        pytest.skip("batching is independent of the backend")
    counts, seen = [], Counter()
    for rank in range(3):  # 240 samples do not divide by 3 * 2 workers * 8
        ds = make(location, cache, batch_size=8, dp_rank=rank, dp_size=7)
        batches = list(DataLoader(ds, batch_size=None, num_workers=2))
        assert all(isinstance(b["i"], torch.Tensor) and isinstance(b["x"], torch.Tensor) for b in batches)
        assert all(1 <= len(b["i"]) <= 8 and b["x"].shape == (len(b["i"]), 4) for b in batches)
        counts.append(len(batches))
        assert len(batches) == len(ds)  # whole batches per worker: as many as with one consumer
        seen.update(ids_of(batches))
        ds.close()
    for rank in range(3, 7):
        ds = make(location, cache, batch_size=8, dp_rank=rank, dp_size=7)
        batches = list(ds)  # one consumer: ceil(35 / 8)
        seen.update(ids_of(batches))
        assert len(batches) == len(ds)
    assert counts[0] == counts[1] == counts[2] == -(-((N + 6) // 7) // 8)
    assert set(seen) == set(range(N)) and sum(seen.values()) - N < 7  # padding only


def test_transform_applied(location: tuple[str, Any], cache: NodeCache) -> None:
    def transform(s: dict[str, Any]) -> dict[str, Any]:
        return {"i": s["i"], "x": s["x"], "y": float(s["i"]) * 2}

    got = list(make(location, cache, transform=transform, shuffle=False))
    assert [s["y"] for s in got] == [2.0 * i for i in range(N)]
    batches = list(make(location, cache, transform=transform, batch_size=8))
    assert all(torch.equal(b["y"], b["i"].double() * 2) for b in batches)


def test_replication_groups(location: tuple[str, Any], cache: NodeCache) -> None:
    per_rank = []
    for r in range(4):
        ds = make(location, cache, replication=2, dist=DistInfo(rank=r, world_size=4, local_rank=r, local_world_size=4))
        assert (ds.dp_rank, ds.dp_size) == (r // 2, 2)
        per_rank.append([int(s["i"]) for s in ds])
        ds.close()
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]
    assert not set(per_rank[0]) & set(per_rank[2])
    assert sorted(per_rank[0] + per_rank[2]) == list(range(N))
    with pytest.raises(ValueError, match="replication"):
        make(location, cache, replication=3, dist=DistInfo(rank=0, world_size=4, local_rank=0, local_world_size=4))


@pytest.mark.timeout(120)
def test_fetch_error_reaches_consumer(location: tuple[str, Any], cache: NodeCache) -> None:
    url, opts = location
    url = url.rstrip("/") + f"-broken-{uuid.uuid4().hex[:6]}/"
    m = write_dataset(_samples(60), url, shard_bytes=600, storage_options=opts, progress=False)
    ds = StreamingDataset(url, storage_options=opts, cache=cache, window=1)  # manifest loaded now
    victim = m.shards[len(m.shards) // 2].name
    with open_store(url, opts) as store:
        store.delete(victim)
        victim_url = store.url_of(victim)
    with pytest.raises(DatacacheError) as info:
        for _ in ds:
            pass
    assert isinstance(info.value, NotFoundError)
    assert victim_url in str(info.value)
    text = "".join(traceback.format_exception(info.value))
    assert "prefetch.py" in text and "_run" in text, "the prefetch thread's frames are missing"
    assert "_load" in text
    ds.close()
    # through DataLoader workers: re-raised in the main process, the worker's traceback in the text
    it = iter(DataLoader(StreamingDataset(url, storage_options=opts, cache=cache), num_workers=2))
    with pytest.raises(DatacacheError) as info:
        for _ in it:
            pass
    assert victim_url in str(info.value) and "prefetch.py" in str(info.value)
    # Free the iterator by reference counting: torch's re-raise leaves a reference cycle, and a
    # DataLoader iterator freed by the cyclic GC waits 5 s per worker (its index queues' feeder
    # threads are finalized before it can send the workers their stop message).
    traceback.clear_frames(info.value.__traceback__)
    del info, it


def _prefetch_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("datacache-prefetch") and t not in before]


def _wait_no_prefetch_threads(before: set[threading.Thread], bound: float = 20.0) -> list[threading.Thread]:
    """The prefetch threads started since ``before`` (this test's: another test's dataset left to
    the garbage collector is not this one's) still alive after ``bound`` seconds."""
    for t in _prefetch_threads(before):
        t.join(bound)
    return _prefetch_threads(before)


@pytest.mark.timeout(120)
def test_abandon_and_close(location: tuple[str, Any], cache: NodeCache) -> None:
    before = set(threading.enumerate())
    ds = make(location, cache, window=1, prefetch=None)
    ds.close()
    ds.close()  # before any iteration, and twice
    for _ in range(2):
        it = iter(ds)
        for k, _ in enumerate(it):
            if k == 30:
                break
        del it
        gc.collect()
    assert not _wait_no_prefetch_threads(before), "prefetch threads outlive an abandoned iteration"
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    del it, loader
    gc.collect()
    assert sorted(int(s["i"]) for s in ds) == list(range(N))  # nothing left pinned or stuck
    ds.close()
    ds.close()
    assert not _wait_no_prefetch_threads(before)
    # every pin was released: a full clear leaves nothing behind
    cache.clear()
    assert cache.stats()["entries_ram"] == 0 and cache.stats()["entries_ssd"] == 0


def test_stats(location: tuple[str, Any], cache: NodeCache) -> None:
    ds = make(location, cache)
    assert sorted(int(s["i"]) for s in ds) == list(range(N))
    st = ds.stats()
    for key in ("remote_bytes", "hits_ram", "consumer_wait_seconds", "misses"):
        assert key in st
    assert st["remote_bytes"] == ds.manifest.total_bytes, "each shard fetched exactly once"
    assert st["misses"] == len(ds.manifest.shards) and st["samples"] == N
    ds.set_epoch(1)
    assert len(list(ds)) == N
    st2 = ds.stats()
    assert st2["remote_bytes"] == st["remote_bytes"] and st2["hits_ram"] >= len(ds.manifest.shards)
    assert st2["consumer_wait_seconds"] >= 0 and len(ds) == N


# ---------------------------------------------------------------------- launcher detection
@pytest.mark.parametrize("env, expected", [
    ({}, DistInfo(0, 1, 0, 1)),
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, DistInfo(5, 8, 1, 4)),
    ({"RANK": "3", "WORLD_SIZE": "4"}, DistInfo(3, 4, 3, 4)),
    ({"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, DistInfo(6, 16, 2, 4)),
    ({"PMI_RANK": "9", "PMI_SIZE": "12", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "6"}, DistInfo(9, 12, 3, 6)),
    ({"PMIX_RANK": "2", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "0", "PMI_LOCAL_SIZE": "2"}, DistInfo(2, 4, 0, 2)),
    ({"SLURM_PROCID": "7", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4"},
     DistInfo(7, 8, 3, 4)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "4(x2)"},
     DistInfo(5, 8, 1, 4)),
    # torchrun's variables win over the Slurm allocation it runs in
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "SLURM_PROCID": "0",
      "SLURM_NTASKS": "1"}, DistInfo(1, 2, 1, 2)),
])
def test_detect(env: dict[str, str], expected: DistInfo) -> None:
    info = detect(env)
    assert info == expected
    assert info.rank in info.node_ranks() and len(info.node_ranks()) == info.local_world_size
    assert info.node_rank == info.rank // info.local_world_size
