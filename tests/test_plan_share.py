"""Epoch start at scale (issue 13.7): a consumer plans only its node's part of the epoch (memory that
grows with the node's share, not with the dataset), the order stays today's, and the node-level work
(the shard-to-node assignment, the node's eviction schedule) is computed once per node and shared
through the cache's control directory (datacache.plan.node_share) with the node's other processes."""
from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import sys
import tracemalloc
from dataclasses import replace
from pathlib import Path

import numpy as np
from hypothesis import given

from datacache._localfs import KeyLock
from datacache.manifest import Manifest, ShardInfo
from datacache.plan import node_share as _nodeshare
from datacache.plan.epoch import PlanSpec, build_plan, epoch_pieces
from datacache.plan.node_assign import _assign, assign_nodes, node_part
from datacache.read.node_schedule import _schedule_table, node_schedule
from tests.helpers.plans import SETTINGS, counts_st, node_specs

ROOT = Path(__file__).resolve().parents[1]

# build_plan of every consumer (see _fingerprints): the plans of the code before node-local planning,
# with the one change made since, the largest of a worker's last runs moved to its end (plan.py's step 4;
# tests/test_node_plan.py's sample-level oracle follows it)
TODAYS = [
    '16f6aa0e662f11ba', '810000dc932ff960', 'a201fc4c10d3307d', '2802d1a0ad8b791c', 'a8102bcba0543fa6',
    '5b4184eb461f7a4f', 'd335cd028b9a8826', 'f771755edcf8620b', '88733e52b2017975', '4e1172d579e16931',
    '2b64c6ddc16aec38', '5f3b9ec99deb6d87', '95c3a620d298bc7a', '576d6d21266371d7', 'fb0eb9957fdea53d',
    '48c021fadabd7300', '5a1e6d195cf43850', 'de927ad978084a02', '9738cab8150bdfe3', '2f02189bfd969dfc',
    '1a5e3bf9f875d490', '817fee1c1530fb79', '19e0e136a7e76147', '0e7c8e9284fd94a8', '63bd88a1a4cfeffe',
    '2f039d97afb96565', '7dfb58bf3b8acf60', '22b93512f080b9cc', '1247696e3f58b1fb', 'ea54ef25b2dd3899',
    '8003be5d29e4005a', 'b2c6b59ee4e7e950', '7661fac518f9666a', 'd6577222db8e765a', '2dff1af77caba9e7',
    'e33ae119b4d1f631', 'cb73990b3a0615ae', 'e37dca2e8d934b2b', '6d3fec2bcdfce1ca', '08dbc02aabe17c08',
    'ebd13f6f2ba68704', 'c77c1d1fbebcbfe8', 'c0c7f842f6d9e65a', 'bf2fd5bf46889b86', 'd2c790b7db3c903b',
    '5b279283a30735aa', 'c2e2baa5a53f09aa', 'ca266b405be21e7d',
]


def _fingerprints() -> list[str]:
    rng = np.random.default_rng(5)
    out = []
    for i, (nodes, rpn, drop, bs, shuffle) in enumerate(itertools.product((2, 3, 5), (1, 2), (False, True), (1, 3),
                                                                          (True, False))):
        counts = rng.integers(0, 30, size=int(rng.integers(1, 40))).tolist()
        counts[0] += sum(counts) == 0
        spec = PlanSpec(seed=i, epoch=i % 4, shuffle=shuffle, drop_last=drop, dp_size=nodes * rpn, num_workers=2,
                        num_nodes=nodes, batch_size=bs)
        h = hashlib.blake2b(digest_size=8)
        for r, w in itertools.product(range(spec.dp_size), range(spec.num_workers)):
            p = build_plan(np.array(counts), replace(spec, dp_rank=r, worker_id=w))
            h.update(np.asarray(p.samples, dtype=np.int64).tobytes())
            h.update(repr((p.runs, p.padded)).encode())
        out.append(h.hexdigest())
    return out


def test_node_local_plans_are_todays_plans() -> None:
    """Every consumer's plan (samples, runs, padding) is the one before node-local planning."""
    assert _fingerprints() == TODAYS


@SETTINGS
@given(counts_st, node_specs())
def test_a_node_part_is_its_segment_of_the_epoch_order(counts: list[int], spec: PlanSpec) -> None:
    """``node_part`` (what a consumer computes) is its node's segment of the whole epoch order."""
    c = np.array(counts, dtype=np.int64)
    full, padded = epoch_pieces(c, spec)
    quota = len(full) // spec.num_nodes
    for k in range(spec.num_nodes):
        part, pad = node_part(c, weights=c, node=k, num_nodes=spec.num_nodes, dp_size=spec.dp_size,
                              drop_last=spec.drop_last, unit=spec.batch_size if spec.drop_last else 1,
                              shuffle=spec.shuffle, seed=spec.seed, epoch=spec.epoch)
        seg = full.cut(k * quota, (k + 1) * quota)
        offsets = np.concatenate([[0], np.cumsum(c)])
        assert pad == padded and np.array_equal(part.samples(offsets), seg.samples(offsets))


def test_a_consumers_plan_memory_grows_with_its_nodes_share() -> None:
    """64 nodes, 200,000 shards: once the run's assignment is known, an epoch's plan allocates
    less than 8 bytes a shard (no full-length order: the node's part only)."""
    shards = 200_000
    counts = np.full(shards, 10, dtype=np.int64)
    counts.flags.writeable = False
    spec = PlanSpec(seed=3, epoch=0, dp_size=128, dp_rank=70, num_workers=2, worker_id=1, num_nodes=64)
    build_plan(counts, spec, shards_only=True)  # the run's assignment and the shard offsets
    tracemalloc.start()
    try:
        build_plan(counts, replace(spec, epoch=1), shards_only=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * shards, f"{peak / shards:.1f} bytes a shard"


_CHILD = """
import sys, numpy as np
from datacache.plan.node_assign import assign_nodes
sizes = np.arange(1, 5001, dtype=np.int64) * 7
owner = assign_nodes(sizes, 5, 9, share_dir=sys.argv[1])
print(type(owner).__name__, owner.dtype, ",".join(map(str, np.bincount(owner, minlength=5))))
"""


def _child(share: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", _CHILD, str(share)], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


def test_the_assignment_is_computed_once_per_node_and_mapped_by_the_others(tmp_path: Path) -> None:
    sizes = np.arange(1, 5001, dtype=np.int64) * 7
    want = _assign(sizes, 5, 9)
    first = _child(tmp_path)
    files = list((tmp_path / "nodeplan").glob("assign-*.npy"))
    assert len(files) == 1 and np.array_equal(np.load(files[0]), want)
    second = _child(tmp_path)  # finds the file: maps it (a memmap), same owners
    assert second.startswith("memmap int16") and first.split()[1:] == second.split()[1:]
    files[0].write_bytes(files[0].read_bytes()[:-100])  # truncated: recomputed and replaced, never used
    assert _child(tmp_path).split()[1:] == first.split()[1:]
    assert np.array_equal(np.load(files[0]), want)


def test_a_wrong_shared_file_is_never_used(tmp_path: Path) -> None:
    sizes = np.arange(1, 301, dtype=np.int64)
    assign_nodes(sizes, 3, 4, share_dir=str(tmp_path))
    [path] = (tmp_path / "nodeplan").glob("assign-*.npy")
    np.save(path, np.full(300, 7, dtype=np.int16))  # node ids out of range
    got = _nodeshare.shared_array(str(tmp_path), path.stem, lambda: _assign(sizes, 3, 4),
                                  lambda a: a.shape == (300,) and int(a.max()) < 3)
    assert np.array_equal(got, _assign(sizes, 3, 4)) and np.array_equal(np.load(path), got)


def test_a_stuck_computer_never_blocks_the_node(tmp_path: Path, monkeypatch) -> None:
    """Another process holds the computer's lock and never publishes: the consumer computes the
    result itself once ``WAIT_S`` has passed."""
    folder = tmp_path / "nodeplan"
    folder.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(600)",
                               KeyLock(str(folder), "x").path], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(_nodeshare, "WAIT_S", 0.3)
        got = _nodeshare.shared_array(str(tmp_path), "x", lambda: np.arange(4), lambda a: a.shape == (4,))
        assert got.tolist() == [0, 1, 2, 3] and not (folder / "x.npy").exists()
    finally:
        holder.kill()
        holder.wait()


def test_the_node_schedule_is_computed_once_and_read_by_the_others(tmp_path: Path, monkeypatch) -> None:
    counts = np.full(40, 6, dtype=np.int64)
    infos = tuple(ShardInfo(f"s{i:03d}", 100, 6, "xxh3:0") for i in range(40))
    manifest = Manifest(format="zstd", schema={}, shards=infos, dataset_id="ds")
    spec = PlanSpec(seed=2, epoch=1, dp_size=4, dp_rank=2, num_workers=2, num_nodes=2,
                    shard_bytes=np.full(40, 100, dtype=np.int64))
    pure = node_schedule(manifest, counts, spec, [2, 3]).times
    mine = node_schedule(manifest, counts, spec, [2, 3], share_dir=str(tmp_path))
    [path] = (tmp_path / "nodeplan").glob("schedule-*.npy")
    assert np.array_equal(np.load(path), _schedule_table(counts, spec, [2, 3], None))
    monkeypatch.setattr("datacache.read.node_schedule._schedule_table", None)  # another consumer: nothing to compute
    other = node_schedule(manifest, counts, replace(spec, dp_rank=3, worker_id=1), [2, 3], share_dir=str(tmp_path))
    assert other.times == mine.times == pure


def test_a_nearly_full_file_system_is_left_to_the_index(tmp_path: Path, monkeypatch) -> None:
    """A plan file never takes the last ``RESERVE`` bytes of the control directory's file system
    (the cache index beside it must still grow): the result is computed and returned, not shared."""
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    monkeypatch.setattr(_nodeshare, "RESERVE", free)  # what is free now is all the reserve
    got = _nodeshare.shared_array(str(tmp_path), "x", lambda: np.arange(4), lambda a: a.shape == (4,))
    assert got.tolist() == [0, 1, 2, 3] and not list((tmp_path / "nodeplan").glob("*.npy"))
    monkeypatch.setattr(_nodeshare, "RESERVE", 0)
    _nodeshare.shared_array(str(tmp_path), "x", lambda: np.arange(4), lambda a: a.shape == (4,))
    assert (tmp_path / "nodeplan" / "x.npy").exists()
