"""A cache whose file system fills up: the SSD tier mid-epoch, the spare pass-through directory,
and a file system full from the start (tiers, the cache index and the node's congestion state on
it). Every sample still comes exactly once; nothing crashes on a mapped file the file system cannot
back; the index's failure is one ``CacheError`` naming it. The tmpfs needs root, or a user
namespace (tests/test_as_user.py runs these tests so)."""
from __future__ import annotations

import logging
from pathlib import Path

import lmdb
import pytest

from datacache import CacheError, NodeCache, StreamingDataset
from datacache.index import Entry, Index
from tests.helpers import faults as H

KB = 1 << 10
SIZE = 8 * KB  # payload bytes per sample


def data_dir(cache: NodeCache, tier: str = "ram") -> str:
    return cache.tiers[tier].data_dir


@pytest.mark.timeout(120)
def test_ssd_fills_up_mid_epoch_degrades_to_pass_through(small_tmpfs: Path, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="datacache")
    url, n = f"file://{tmp_path}/ds", 160
    m = H.write(url, None, n, SIZE, shard_bytes=8 * SIZE)  # 20 shards of ~66 KB
    # RAM tier smaller than a shard (never admits one; pass-through files live there), SSD budget
    # far beyond the 24 MB file system: shrunk at open with one warning.
    cfg = H.cache_config(tmp_path, ram="32KB", ssd="1GB", ssd_dir=str(small_tmpfs / "ssd"))
    # The window (whole shards): a part mix here falls back to whole fetches once the copies find
    # no room, and a pass-through shard is then fetched once per chunk that reads it.
    ds = StreamingDataset(url, cache=cfg, node_shuffle="never")
    assert ds.cache.ssd.enabled and ds.cache.ssd.budget < 32 << 20
    assert len(H.warnings_with(caplog, "shrunk")) == 1
    # Room for about three shards, then ENOSPC mid-shard; what that partial file held is freed
    # again, which leaves the cache index (on the same file system) a few pages to grow into.
    H.fill_up(small_tmpfs, leave=3 * m.shards[0].bytes + 48 * KB)
    H.assert_exactly_once(ds, n, SIZE)
    assert len(H.warnings_with(caplog, "ssd tier disabled")) == 1
    st = ds.stats()
    assert st["entries_ssd"] >= 1 and st["bypassed"] > 0  # filled up mid-epoch
    assert st["fetches"] == len(m.shards) and st["budget_ssd"] == 0
    ds.set_epoch(1)
    H.assert_exactly_once(ds, n, SIZE)  # and keeps working: SSD hits where it had room, pass-through else
    assert len(H.warnings_with(caplog, "disabled")) == 1 and len(H.warnings_with(caplog, "shrunk")) == 1
    assert H.leftovers(data_dir(ds.cache), data_dir(ds.cache, "ssd")) == []
    ds.close()
    ds.cache.close()


@pytest.mark.timeout(60)
def test_ssd_full_and_no_ram_tier_continues_through_a_spare_pass_dir(small_tmpfs: Path, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """No RAM tier and the SSD's file system full: pass-through copies move to a private dir on
    another file system (/dev/shm or the temp dir) with one warning, and the epoch completes."""
    caplog.set_level(logging.WARNING, logger="datacache")
    url, n = f"file://{tmp_path}/ds", 40
    H.write(url, None, n, SIZE, shard_bytes=8 * SIZE)
    ds = StreamingDataset(url, cache=H.cache_config(tmp_path, ram=0, ssd="1GB", ssd_dir=str(small_tmpfs / "ssd")))
    H.fill_up(small_tmpfs, leave=20 * KB)
    H.assert_exactly_once(ds, n, SIZE)
    assert ds.cache.pass_dir != data_dir(ds.cache, "ssd")
    assert sum("pass-through" in r.getMessage() for r in caplog.records) == 1
    assert H.leftovers(data_dir(ds.cache, "ssd")) == [] and H.leftovers(ds.cache.pass_dir) == []
    ds.close()
    ds.cache.close()


@pytest.mark.timeout(120)
def test_file_system_full_from_the_start_the_epoch_completes(small_tmpfs: Path, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Both tiers, the index and the node's congestion state on one file system that another
    program has filled to the last byte: the epoch gives every sample once (tiers off, pass-through
    elsewhere, the congestion state private to the process: before, touching its sparse mapped
    file killed the process with SIGBUS); the counters wait, with one warning, and are written once
    there is room again; close() works."""
    caplog.set_level(logging.WARNING, logger="datacache")
    url, n = f"file://{tmp_path}/ds", 80
    H.write(url, None, n, SIZE, shard_bytes=8 * SIZE)
    cfg = H.cache_config(tmp_path, ram="4MB", ssd="8MB", ram_dir=str(small_tmpfs / "ram"),
                         ssd_dir=str(small_tmpfs / "ssd"))
    ds = StreamingDataset(url, cache=cfg)
    H.fill_up(small_tmpfs, leave=0)
    H.assert_exactly_once(ds, n, SIZE)
    assert len(H.warnings_with(caplog, "congestion state")) == 1
    assert len(H.warnings_with(caplog, "the cache index could not be written")) == 1
    (small_tmpfs / "someone-elses-file").unlink()
    assert ds.stats()["samples"] == n  # the pending counters, written now
    ds.close()
    ds.close()
    ds.cache.close()


@pytest.mark.timeout(60)
def test_full_index_is_one_cache_error_naming_it(small_tmpfs: Path) -> None:
    """Writes to an index whose file system is full fail as ``CacheError`` naming the index and
    what to do, from LMDB's error (it was ``lmdb.DiskError`` before); counters whose flush failed
    stay pending and are written once there is room."""
    index = Index(str(small_tmpfs))
    with index.write() as txn:
        txn.put("first", Entry(1, "h", 0.0, {"ram": {"file": "f", "token": "t"}}))
    H.fill_up(small_tmpfs, leave=0)
    with pytest.raises(CacheError) as err:
        for i in range(10_000):  # new pages until LMDB's free pages run out
            with index.write() as txn:
                txn.put(f"k{i}", Entry(i, "h" * 4000, 0.0, {"ram": {"file": "f" * 4000, "token": "t"}}))
    assert isinstance(err.value.__cause__, lmdb.Error)
    assert str(small_tmpfs / "index.lmdb") in str(err.value) and "free space" in str(err.value)
    index.count(hits_ram=2)
    index.flush()  # fails too: the counters stay pending (one warning), no error
    (small_tmpfs / "someone-elses-file").unlink()
    index.flush()
    with index.read() as txn:
        assert txn.counters()["hits_ram"] == 2.0
    index.close()
