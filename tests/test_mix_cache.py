"""A mix through a limited node cache: one plan over every stream's shards, so clairvoyant
eviction keeps remote bytes per epoch (after the first) near the bound ``D - C`` of MIN, as for one
dataset of the streams' bytes (``D``: the distinct bytes an epoch reads; ``C``: the cache)."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from datacache import CacheConfig, NodeCache, Stream, StreamingDataset, write_dataset

N = 480
EPOCHS = 4
SLACK = 1.05


@pytest.fixture(scope="module")
def two_streams(s3_server: Any) -> list[tuple[str, int]]:
    """Two streams of N incompressible samples (the bytes on the wire are what the cache holds):
    [(url, total bytes)]."""
    out = []
    for width, seed in ((256, 1), (160, 2)):
        rng = np.random.default_rng(seed)
        url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/"
        m = write_dataset(({"i": i, "x": rng.integers(0, 256, width, dtype=np.uint8)} for i in range(N)), url,
                          shard_bytes=2048, storage_options=s3_server.storage_options(), progress=False)
        assert len(m.shards) >= 8
        out.append((url, m.total_bytes))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batching, repeat", [("random", 1), ("stratified", 1), ("random", 2)])
def test_mix_remote_bytes_within_the_bound(two_streams: list[tuple[str, int]], s3_server: Any, tmp_path: Path,
                                           batching: str, repeat: int) -> None:
    """``repeat=2``: the second stream is read twice per epoch (each of its shards twice)."""
    capacity = sum(d for _, d in two_streams) // 2
    config = CacheConfig(ram_bytes=capacity, ssd_bytes=0, ram_dir=str(tmp_path / "ram"), ssd_dir=str(tmp_path / "ssd"))
    opts = s3_server.storage_options()
    with NodeCache(config) as cache:
        ds = StreamingDataset(streams=[Stream(u, repeat=k, storage_options=opts) for u, k in
                                       [(two_streams[0][0], 1), (two_streams[1][0], repeat)]],
                              batch_size=8, batching=batching, cache=cache, seed=3)
        per_epoch, seen = [], 0
        for epoch in range(EPOCHS):
            ds.set_epoch(epoch)
            assert sum(len(b["i"]) for b in ds) == (1 + repeat) * N
            total = cache.stats()["remote_bytes"]
            per_epoch.append(total - seen)
            seen = total
        ds.close()
    bound = sum(d for _, d in two_streams) - capacity
    print(f"{batching}, repeat {repeat}: remote bytes per epoch {per_epoch}, bound {bound}: "
          f"{[round(b / bound, 3) for b in per_epoch[1:]]} x")
    assert all(b <= SLACK * bound for b in per_epoch[1:]), (per_epoch, bound)
