"""CachedDataset: map-style reads in a planned order, prefetched and cached; off-plan reads work."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

import datacache


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("mapped")
    samples = ({"i": i, "x": np.full(300, i % 251, dtype=np.uint8)} for i in range(600))
    datacache.write_dataset(samples, f"file://{root}/ds", shard_bytes=20_000, progress=False)
    return f"file://{root}/ds"


def make(url: str, tmp_path, **kw) -> datacache.CachedDataset:
    cfg = datacache.CacheConfig(ram_bytes="64MB", ssd_bytes=0, ram_dir=str(tmp_path / "ram"),
                                ssd_dir=str(tmp_path / "ssd"))
    return datacache.CachedDataset(url, cache=cfg, **kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_planned_order_with_a_sampler(url: str, tmp_path, workers: int) -> None:
    ds = make(url, tmp_path)
    order = list(RandomSampler(range(len(ds)), generator=torch.Generator().manual_seed(0)))
    ds.plan(order, batch_size=16)
    loader = DataLoader(ds, batch_size=16, sampler=order, num_workers=workers)
    got = [int(i) for b in loader for i in b["i"]]
    assert got == order
    st = ds.cache.stats()
    assert st["fetches"] == len(ds.manifest.shards)  # each shard fetched once for the node
    ds.close()


def test_sequential_plan_reads_runs_and_off_plan_reads_work(url: str, tmp_path) -> None:
    ds = make(url, tmp_path, transform=lambda s: (s["i"], int(s["x"][0])))
    ds.plan(range(100, 400))
    assert [ds[i] for i in range(100, 200)] == [(i, i % 251) for i in range(100, 200)]
    assert ds[5] == (5, 5)  # off plan
    assert [ds[i] for i in range(200, 400)] == [(i, i % 251) for i in range(200, 400)]
    assert ds[599] == (599, 599 % 251)  # after the plan ends
    with pytest.raises(IndexError):
        ds.plan([len(ds)])
    ds.close()
    ds.close()
