"""DataLoader workers started with ``spawn`` or ``forkserver`` (macOS's default, and Linux's from
Python 3.14): the dataset pickles (its node cache as its config), every worker opens the same node
cache, an epoch is exactly once, and a second epoch is served from the cache the first filled."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.utils.data as tud

from datacache import StreamingDataset
from tests.helpers import faults as H


@pytest.mark.timeout(240)
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawned_workers_share_the_node_cache_exactly_once(context: str, small_dataset: Any,
                                                          tmp_path: Path) -> None:
    url, opts, m = small_dataset
    ds = StreamingDataset(url, storage_options=opts, cache=H.cache_config(tmp_path))
    for epoch in range(2):
        ds.set_epoch(epoch)
        loader = tud.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
        H.assert_exactly_once(loader, m.num_samples, 1000)
        if epoch == 0:
            first = ds.stats()
    second = ds.stats()
    assert first["remote_bytes"] >= m.total_bytes
    assert second["remote_bytes"] == first["remote_bytes"]  # epoch 2 came from the cache
    ds.close()
    ds.cache.close()
