"""The README's D - C claim, counted in bytes at the proxy (never timed).

A reshuffled once-per-epoch read of D bytes through C bytes of cache must fetch at least D - C per
epoch after the first (what the cache does not hold), and the clairvoyant default (Belady's MIN
with bypass, from the epoch's plan) fetches about that: StreamingDataset through a DataLoader with
2 workers, a RAM tier of D / 2 and no SSD tier, 3 epochs, every epoch exactly once and every byte
checked (LRU: ~0.8 D). tools/bound_check.py prints the same figures; the multi-process variant
(2 ranks x 2 workers sharing one node cache) is in tests/test_multinode.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

import datacache
from datacache import StreamingDataset
from tests.helpers import faults as H

SIZE = 4000  # bytes of payload per sample (incompressible)
SLACK = 1.05


@pytest.mark.timeout(300)
@pytest.mark.parametrize("loader_cls", [DataLoader, datacache.DataLoader], ids=["torch", "datacache"])
def test_two_workers_read_d_minus_c_after_the_first_epoch(s3_server: Any, make_s3_url: Any, slowlink: Any,
                                                         tmp_path: Path, loader_cls: Any) -> None:
    """Through torch's DataLoader, and through datacache.DataLoader, whose head start (the training
    process fetching the workers' first shards, datacache.read.headstart) must not fetch a byte more."""
    n, per_shard = 768, 32  # 24 shards of ~128 KB: D ~ 3 MB
    url = make_s3_url()
    m = H.write(url, s3_server.storage_options(), n, SIZE, shard_bytes=per_shard * SIZE)
    assert len(m.shards) == n // per_shard
    d = m.total_bytes
    c = d // 2
    link = slowlink()
    ds = StreamingDataset(url, storage_options=s3_server.storage_options(link.endpoint_url), seed=11,
                          cache=H.cache_config(tmp_path, ram=c, ssd=0))
    assert ds.cache.ram.budget == c and not ds.cache.ssd.enabled
    assert ds.cache.config.policy == "auto"  # the default: clairvoyant once the plan is known
    loader = loader_cls(ds, batch_size=None, num_workers=2, persistent_workers=True)
    per_epoch, orders = [], []
    for epoch in range(3):
        ds.set_epoch(epoch)
        before = link.snapshot()["bytes_down"]
        orders.append(H.assert_exactly_once(loader, n, SIZE))  # every sample once, every byte right
        per_epoch.append(link.snapshot()["bytes_down"] - before)
    print(f"\nD = {d} B, C = {c} B, D - C = {d - c} B; remote bytes per epoch at the proxy: {per_epoch}")
    assert orders[0] != orders[1] != orders[2], "epochs do not reshuffle"
    assert d <= per_epoch[0] <= SLACK * d, "the first epoch reads the dataset once"
    for e in (1, 2):
        assert per_epoch[e] <= SLACK * (d - c), f"epoch {e + 1} read {per_epoch[e]} B; D - C = {d - c} B"
    del loader
    ds.close()
    ds.cache.close()
