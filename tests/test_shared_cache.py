"""Two datasets through one node cache: the cache's schedule covers every dataset in use on the node.

A clairvoyant cache (Belady's MIN with bypass) that knows only one dataset's future treats the
other's entries as never used again: it evicts them first, never demotes them and refuses them
admission, so both datasets thrash. With every dataset's plan known (in one process, and across
processes through the cache's directories), two datasets of D1 and D2 bytes read through C bytes of
cache fetch at most about (D1 + D2) - C per epoch after the first, as one dataset of D1 + D2 would.
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from datacache import CacheConfig, NodeCache, Schedule, StreamingDataset, write_dataset
from datacache.cache.eviction import INF
from datacache.cache.node_policy import NodePolicy

HERE = Path(__file__).resolve().parent
N = 480  # samples per dataset: equal counts, so zip() reads both in lockstep
EPOCHS = 4
SLACK = 1.1
EPOCH_SLACK = 1.2  # any one epoch of two processes (test_two_datasets_two_processes)


def _samples(width: int, seed: int):
    rng = np.random.default_rng(seed)  # incompressible: the bytes on the wire are what the cache holds
    return ({"i": i, "x": rng.integers(0, 256, width, dtype=np.uint8)} for i in range(N))


@pytest.fixture(scope="module")
def two_datasets(s3_server: Any) -> list[tuple[str, int]]:
    """Two datasets of N samples (different widths, so D1 != D2) on the session's S3 server:
    [(url, total bytes)] each."""
    opts = s3_server.storage_options()
    out = []
    for width, seed in ((256, 1), (160, 2)):
        url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/"
        m = write_dataset(_samples(width, seed), url, shard_bytes=4096, storage_options=opts, progress=False)
        assert len(m.shards) >= 12
        out.append((url, m.total_bytes))
    return out


def _config(tmp_path: Path, ram: int, ssd: int) -> CacheConfig:
    return CacheConfig(ram_bytes=ram, ssd_bytes=ssd, ram_dir=str(tmp_path / "ram"), ssd_dir=str(tmp_path / "ssd"))


def _bound(two_datasets: list[tuple[str, int]], capacity: int) -> int:
    """Remote bytes per epoch (after the first) of MIN over both datasets: (D1 + D2) - C."""
    return sum(d for _, d in two_datasets) - capacity


def _zip_epochs(cache: NodeCache, two_datasets: list[tuple[str, int]], opts: dict[str, Any],
                num_workers: int) -> list[int]:
    """Iterate both datasets interleaved (zip of two DataLoaders with ``num_workers`` each) for
    EPOCHS epochs through ``cache``; the remote bytes of each epoch."""
    dss = [StreamingDataset(url, storage_options=opts, cache=cache, seed=s) for s, (url, _) in enumerate(two_datasets)]
    loaders = [DataLoader(ds, batch_size=None, num_workers=num_workers) for ds in dss]
    per_epoch, seen = [], 0
    for epoch in range(EPOCHS):
        for ds in dss:
            ds.set_epoch(epoch)
        counts = [0, 0]
        for pair in itertools.zip_longest(*loaders):
            for j, s in enumerate(pair):
                counts[j] += s is not None
        assert counts == [N, N]
        total = cache.stats()["remote_bytes"]
        per_epoch.append(total - seen)
        seen = total
    for ds in dss:
        ds.source.close()
    return per_epoch


@pytest.mark.timeout(300)
def test_two_datasets_one_process_ram_only(two_datasets: list[tuple[str, int]], s3_server: Any,
                                           tmp_path: Path) -> None:
    capacity = sum(d for _, d in two_datasets) // 2
    with NodeCache(_config(tmp_path, capacity, 0)) as cache:
        per_epoch = _zip_epochs(cache, two_datasets, s3_server.storage_options(), num_workers=2)
    bound = _bound(two_datasets, capacity)
    print("remote bytes per epoch", per_epoch, "bound", bound)
    assert all(b <= SLACK * bound for b in per_epoch[1:]), (per_epoch, bound)


@pytest.mark.timeout(300)
def test_two_datasets_one_process_ram_and_ssd(two_datasets: list[tuple[str, int]], s3_server: Any,
                                              tmp_path: Path) -> None:
    """RAM holds a third of C, the SSD tier the rest (read in the main process: with DataLoader
    workers the two tiers measured 1.11-1.20x the bound, one dataset alone 1.05-1.11x)."""
    capacity = sum(d for _, d in two_datasets) // 2
    ram = capacity // 3
    with NodeCache(_config(tmp_path, ram, capacity - ram)) as cache:
        per_epoch = _zip_epochs(cache, two_datasets, s3_server.storage_options(), num_workers=0)
        used_ssd = cache.stats()["used_ssd"]
    bound = _bound(two_datasets, capacity)
    print("remote bytes per epoch", per_epoch, "bound", bound, "ssd used", used_ssd)
    assert used_ssd > 0, "the SSD tier must hold data"
    assert all(b <= SLACK * bound for b in per_epoch[1:]), (per_epoch, bound)


@pytest.mark.timeout(300)
def test_two_datasets_two_processes(two_datasets: list[tuple[str, int]], s3_server: Any, tmp_path: Path) -> None:
    """Two jobs on one node, each reading its own dataset through the same cache directories, their
    epochs started together (``tests.helpers.shared_cache_job`` waits for the test before each epoch)."""
    capacity = sum(d for _, d in two_datasets) // 2
    cfg = _config(tmp_path, capacity, 0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(HERE / "helpers" / "shared_cache_job.py"), url, cfg.ram_dir,
                               cfg.ssd_dir, str(capacity), str(EPOCHS), repr(s3_server.storage_options())],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for url, _ in two_datasets]
    try:
        with NodeCache(cfg) as cache:
            per_epoch, seen = [], 0
            for epoch in range(EPOCHS + 1):
                assert [p.stdout.readline().strip() for p in procs] == ["ready" if epoch < EPOCHS else "done"] * 2
                total = cache.stats()["remote_bytes"]
                if epoch:
                    per_epoch.append(total - seen)
                seen = total
                for p in procs:
                    if epoch < EPOCHS:
                        p.stdin.write("go\n")
                        p.stdin.flush()
        for p in procs:
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bound = _bound(two_datasets, capacity)
    print("remote bytes per epoch", per_epoch, "bound", bound)
    # Two processes' clocks drift apart by whatever share of the CPU each gets, and the policy
    # compares them as if they moved at one pace: one epoch may then fetch a shard or two more
    # (one 4 KB shard is 3.6 % of the bound). Measured: 1.01-1.03 x per epoch idle and with both
    # cores busy, one epoch at 1.100 x in a CI run (mean 1.044 x). With the other process's plan
    # ignored (the bug this test is for) every epoch measured 1.29-1.42 x, mean 1.36-1.37 x.
    later = per_epoch[1:]
    assert sum(later) <= SLACK * bound * len(later), (per_epoch, bound)
    assert all(b <= EPOCH_SLACK * bound for b in later), (per_epoch, bound)


# --------------------------------------------------------------------------- the node policy itself
def _plan(ds: str, shards: list[str], epoch: int) -> Schedule:
    """A node schedule of dataset ``ds``: ``shards`` read in order in ``epoch`` and ``epoch + 1``."""
    n = len(shards)
    return Schedule({f"{ds}/{s}": [epoch + i / n, epoch + 1 + i / n] for i, s in enumerate(shards)})


def test_one_schedule_per_dataset_in_one_process() -> None:
    p = NodePolicy()
    a, b = _plan("ds-a", ["s0", "s1"], 5), _plan("ds-b", ["s0", "s1"], 0)
    p.tell(a)
    assert p.score("ds-b/s0", 0) == INF  # no one told ds-b yet
    p.tell(b)  # does not replace ds-a's
    assert p.datasets() == {"ds-a": 1, "ds-b": 1}
    a.advance(5.0)
    b.advance(0.0)
    # Datasets at different epochs compare by distance to the next use on their own clock.
    assert p.score("ds-a/s1", 0) == p.score("ds-b/s1", 0) == 0.5
    assert p.incoming_score("ds-b/s1", use_at=0.5) == 1.5 and p.worth_keeping("ds-a/s0")
    p.tell(_plan("ds-a", ["s1", "s0"], 6))  # a new epoch of ds-a replaces its schedule
    assert p.datasets() == {"ds-a": 1, "ds-b": 1} and p.score("ds-a/s1", 0) == 0
    assert p.score("ds-c/s0", 0) == INF and not p.should_promote("ds-c/s0") and p.score("plain", 0) == INF
    p.close()


def _child_publishes(control_dir: str, conn: Any) -> None:
    p = NodePolicy(control_dir)
    s = _plan("ds-child", ["s0", "s1", "s2", "s3"], 2)
    p.tell(s)
    s.advance(2.5)
    conn.send("ready")
    conn.poll(120)  # until killed (or the test is gone)
    os._exit(0)


def test_plans_are_shared_between_processes_and_dropped_when_their_process_dies(tmp_path: Path) -> None:
    control = str(tmp_path / "control")
    ctx = mp.get_context("fork")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_child_publishes, args=(control, child_conn), daemon=True)
    child.start()
    mine = NodePolicy(control)
    try:
        assert conn.poll(60) and conn.recv() == "ready"
        mine.tell(_plan("ds-mine", ["s0"], 0))  # telling scans the board
        assert mine.datasets() == {"ds-mine": 1, "ds-child": 1}
        # The child's clock is at 2.5: s2 (read at 2.5) is next read at 3.5, s3 at 2.75.
        assert mine.score("ds-child/s3", 0) == 0.25 and mine.score("ds-child/s2", 0) == 1.0
        board = Path(control, "plans")
        assert len(list(board.glob("ds-child-*.plan"))) == 1
        child.kill()
        child.join(30)
        mine.refresh(rescan=True)
        assert mine.datasets() == {"ds-mine": 1}, "a dead process's plan must not pin the cache"
        assert mine.score("ds-child/s3", 0) == INF and not list(board.glob("ds-child-*"))
    finally:
        child.kill()
        child.join(30)
        mine.close()


def test_a_forked_child_sees_its_parents_plan_without_releasing_it(tmp_path: Path) -> None:
    control = str(tmp_path / "control")
    parent = NodePolicy(control)
    s = _plan("ds-p", ["s0", "s1"], 0)
    parent.tell(s)
    s.advance(0.0)
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child() -> None:
        parent.refresh(rescan=True)  # the inherited policy forgot its parent's schedule: found on the board
        q.put((parent.datasets(), parent.score("ds-p/s1", 0)))

    proc = ctx.Process(target=child)
    proc.start()
    assert q.get(timeout=60) == ({"ds-p": 1}, 0.5)
    proc.join(30)
    other = NodePolicy(control)
    other.refresh(rescan=True)
    assert other.datasets() == {"ds-p": 1}, "the child's exit must not release the parent's plan"
    parent.close()
    other.refresh(rescan=True)
    assert other.datasets() == {}
    other.close()


def test_a_plan_whose_clock_stopped_long_ago_is_ignored_until_it_moves(tmp_path: Path) -> None:
    control = str(tmp_path / "control")
    job, other = NodePolicy(control), NodePolicy(control, stale_s=600)
    s = _plan("ds-idle", ["s0", "s1"], 0)
    job.tell(s)
    other.refresh(rescan=True)
    assert other.datasets() == {"ds-idle": 1}
    (clock,) = Path(control, "plans").glob("ds-idle-*.clock")
    os.utime(clock, (clock.stat().st_atime, clock.stat().st_mtime - 3600))  # last moved an hour ago
    other.refresh(rescan=True)
    assert other.datasets() == {} and other.score("ds-idle/s1", 0) == INF
    s.advance(0.5)  # reading again
    other.refresh(rescan=True)
    assert other.datasets() == {"ds-idle": 1} and other.score("ds-idle/s0", 0) == 0.5  # next read at 1.0
    job.close()
    other.close()
