"""A cache whose file system fills up: the SSD tier mid-epoch, the spare pass-through directory,
and a file system full from the start (tiers, the cache index and the node's congestion state on
it). Every sample still comes exactly once; nothing crashes on a mapped file the file system cannot
back; the index's failure is one ``CacheError`` naming it. The tmpfs needs root, or a user
namespace (tests/test_as_user.py runs these tests so)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lmdb
import pytest

from datacache import CacheError, NodeCache, StreamingDataset
from datacache.cache.index import Entry, Index
from tests.helpers import faults as H

KB = 1 << 10
SIZE = 8 * KB  # payload bytes per sample


def data_dir(cache: NodeCache, tier: str = "ram") -> str:
    return cache.tiers[tier].data_dir


def _out_of_space(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings that a tier or the pass-through copies ran out of space."""
    return [m for m in H.warnings_with(caplog, "datacache") if "short of space" in m or "disabled at" in m
            or "pass-through" in m]


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
    # Room for about three shards beside the tier's reserve, then no room (one warning: new entries
    # skip the tier, or it is turned off where a write hit ENOSPC first).
    H.fill_up(small_tmpfs, leave=ds.cache.ssd.reserve // 4 + 3 * m.shards[0].bytes + 48 * KB)
    H.assert_exactly_once(ds, n, SIZE)
    assert len(_out_of_space(caplog)) == 1, _out_of_space(caplog)
    st = ds.stats()
    assert st["entries_ssd"] >= 1 and st["bypassed"] > 0  # filled up mid-epoch
    assert st["fetches"] == len(m.shards)
    ds.set_epoch(1)
    H.assert_exactly_once(ds, n, SIZE)  # and keeps working: SSD hits where it had room, pass-through else
    assert len(_out_of_space(caplog)) == 1 and len(H.warnings_with(caplog, "shrunk")) == 1
    assert H.leftovers(data_dir(ds.cache), data_dir(ds.cache, "ssd")) == []
    ds.close()
    ds.cache.close()


@pytest.mark.timeout(60)
def test_ssd_full_and_no_ram_tier_continues_through_a_spare_pass_dir(small_tmpfs: Path, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """No RAM tier and the SSD's file system full: pass-through copies go to a private dir on
    another file system (/dev/shm or the temp dir) with one warning, and the epoch completes."""
    caplog.set_level(logging.WARNING, logger="datacache")
    url, n = f"file://{tmp_path}/ds", 40
    H.write(url, None, n, SIZE, shard_bytes=8 * SIZE)
    ds = StreamingDataset(url, cache=H.cache_config(tmp_path, ram=0, ssd="1GB", ssd_dir=str(small_tmpfs / "ssd")))
    H.fill_up(small_tmpfs, leave=20 * KB)
    H.assert_exactly_once(ds, n, SIZE)
    assert H.files(data_dir(ds.cache, "ssd")) == {}  # every copy went elsewhere
    assert len(_out_of_space(caplog)) == 1, _out_of_space(caplog)
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


@pytest.mark.timeout(120)
def test_a_tier_shrunk_to_a_small_file_system_never_fills_it_itself(small_tmpfs: Path, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Issue 37, point 15: a RAM tier asking for more than its 32 MB file system (Docker's 64 MB
    /dev/shm) is shrunk with room left beside it, and new entries skip it while the files beside
    its entries (entries being fetched, pass-through copies, evicted shards still mapped by
    samples) leave too little, so epochs of a dataset larger than the tier, with nothing else
    writing there, never hit ENOSPC: the tier stays on and keeps its entries (before, they filled
    a budget of 90 % of the file system, and the tier was off for the rest of the process)."""
    caplog.set_level(logging.WARNING, logger="datacache")
    url, n, size = f"file://{tmp_path}/ds", 1200, 32 * KB
    H.write(url, None, n, size, shard_bytes=1_000_000)  # 40 MB in 1 MB shards
    ds = StreamingDataset(url, cache=H.cache_config(tmp_path, ram="4GB", ram_dir=str(small_tmpfs / "ram")))
    try:
        assert ds.cache.ram.enabled and len(H.warnings_with(caplog, "shrunk")) == 1
        for epoch in range(2):
            ds.set_epoch(epoch)
            H.assert_exactly_once(ds, n, size)
            st = ds.stats()
            assert ds.cache.ram.enabled and st["budget_ram"] == ds.cache.ram.budget, st
            assert st["entries_ram"] > 0 and st["used_ram"] > ds.cache.ram.budget // 2, st
        assert H.warnings_with(caplog, "disabled") == [] and H.warnings_with(caplog, "pass-through") == []
        assert len(H.warnings_with(caplog, "short of space")) <= 1  # said once (transient: skipped meanwhile)
    finally:
        ds.close()
        ds.cache.close()


def test_a_tier_turned_off_by_a_full_file_system_is_on_again_once_there_is_room(
        small_tmpfs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 37, point 15: another program fills the RAM tier's file system; a fetch of unknown
    size into the tier hits ENOSPC and turns the tier off (one warning); once the space is back,
    the next fetch finds the tier on again (one warning) and caches there."""
    from datacache import CacheConfig

    caplog.set_level(logging.WARNING, logger="datacache")
    cfg = CacheConfig(ram_bytes="8MB", ssd_bytes=0, ram_dir=str(small_tmpfs / "ram"), ssd_dir=str(tmp_path / "ssd"))
    big = bytes(range(256)) * (12 << 12)  # 12 MB: more than the file system will have free

    def fetch(data: bytes) -> Any:
        def write(path: str) -> None:
            with open(path, "wb") as f:
                f.write(data)
        return write
    with NodeCache(cfg) as cache:
        H.fill_up(small_tmpfs, leave=cache.ram.reserve)
        handle = cache.get("big", fetch(big))  # no size known: the tier is tried, ENOSPC
        assert handle.tier == "pass" and handle.read() == big
        handle.release()
        assert not cache.ram.enabled and len(H.warnings_with(caplog, "ram tier disabled")) == 1
        assert "until its file system has room again" in H.warnings_with(caplog, "ram tier disabled")[0]
        (small_tmpfs / "someone-elses-file").unlink()
        small = bytes(range(256)) * (1 << 12)  # 1 MB
        handle = cache.get("small", fetch(small), size=len(small))
        assert handle.tier == "ram" and handle.read() == small
        handle.release()
        assert cache.ram.enabled and len(H.warnings_with(caplog, "ram tier enabled again")) == 1
        assert cache.stats()["entries_ram"] == 1
