"""Faults: nothing is lost and nothing escapes the cache when the store, a worker, the training
process, the SSD or the bytes on disk fail. Real processes, a real S3 server (SeaweedFS) behind a
fault-injecting proxy (tools/slowlink.py), real signals; every multi-process test has a timeout
mark so a hang fails. See README "Reliability" for the table of cases.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from datacache import (
    CacheConfig,
    NodeCache,
    PrefetchConfig,
    RetryConfig,
    StreamingDataset,
    TransferConfig,
    TransientStorageError,
)
from datacache._localfs import KeyLock, key_id
from datacache.cache.index import Index
from tests.helpers import faults as H
from tools.s3server import SeaweedServer
from tools.slowlink import SlowLink

KB = 1 << 10
SIZE = 8 * KB  # payload bytes per sample


def data_dir(cache: NodeCache, tier: str = "ram") -> str:
    return cache.tiers[tier].data_dir


# --------------------------------------------------------------------------- the store dies
@pytest.mark.timeout(150)
def test_store_killed_mid_epoch_and_restarted_within_the_retry_window(tmp_path: Path) -> None:
    # A dedicated server whose objects survive a restart (data_dir); it comes back on new ports, so
    # the dataset talks to a proxy that is re-pointed at it: the endpoint never changes.
    srv = SeaweedServer(bucket="datacache-faults", data_dir=str(tmp_path / "weed"))
    srv.start()
    link = SlowLink("127.0.0.1", srv.port, bandwidth=2e6, latency=0.0).start()
    try:
        opts = srv.storage_options(link.endpoint_url)
        url = f"s3://{srv.bucket}/ds/"
        n = 160
        m = H.write(url, opts, n, SIZE, shard_bytes=8 * SIZE)
        retry = RetryConfig(attempts=200, base_delay=0.05, max_delay=0.5, deadline=30)
        ds = StreamingDataset(url, storage_options=opts, cache=H.cache_config(tmp_path / "c1", ram="1MB"),
                              retry=retry, prefetch=PrefetchConfig(threads=2, lookahead_bytes=1, max_lookahead_bytes=1))
        it = iter(ds)
        got = [next(it) for _ in range(24)]

        os.killpg(srv._proc.pid, signal.SIGKILL)  # the store dies mid-epoch
        srv._proc.wait(10)
        tried = link.snapshot()["connections"]

        def restart() -> None:  # once the dataset has met the dead store twice (a failure and a retry)
            H.wait_for(lambda: link.snapshot()["connections"] >= tried + 2, 60, "the dataset to retry the dead store")
            srv.stop()
            srv.start()  # new ports, same objects
            link.retarget("127.0.0.1", srv.port)

        t = threading.Thread(target=restart, name="restart-store")
        t.start()
        got += list(it)
        t.join(60)
        H.assert_exactly_once(got, n, SIZE)
        st = ds.stats()
        assert st["storage_retries"] > 0, "the outage was never noticed"
        assert st["fetches"] == len(m.shards) and st["corrupt"] == 0
        ds.close()
        ds.cache.close()

        # Down past the window: bounded retries, then one clear error naming the object.
        ds = StreamingDataset(url, storage_options=opts, cache=H.cache_config(tmp_path / "c2", ram="1MB"),
                              retry=RetryConfig(attempts=4, base_delay=0.05, max_delay=0.2, deadline=5))
        os.killpg(srv._proc.pid, signal.SIGKILL)
        srv._proc.wait(10)
        with pytest.raises(TransientStorageError) as info:
            for _ in ds:
                pass
        err = info.value
        assert err.url.startswith(url) and err.url.endswith(tuple(s.name for s in m.shards))
        assert err.url in str(err) and "4 attempts" in str(err) and err.__cause__ is not None
        assert ds.cache.entries() == [] and H.leftovers(data_dir(ds.cache)) == []
        ds.close()
        ds.cache.close()
    finally:
        link.stop()
        srv.stop()


# --------------------------------------------------------------------------- a worker dies
def _worker_downloading(lock_dir: str, tmp_dir: str, pids: set[int], total: int) -> tuple[int, str] | None:
    """(pid, key id) of a worker holding a key lock while its temp file is partly written."""
    inodes = {}
    for name in os.listdir(lock_dir):
        try:
            inodes[os.stat(os.path.join(lock_dir, name)).st_ino] = name.removesuffix(".lock")
        except FileNotFoundError:
            pass
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if "->" in line or len(parts) < 6 or parts[1] != "FLOCK" or parts[3] != "WRITE":
                continue
            pid, ino = int(parts[4]), int(parts[5].split(":")[-1])
            kid = inodes.get(ino)
            if pid in pids and kid is not None:
                size = H.files(tmp_dir).get(f".tmp-{kid}", 0)
                if 0 < size < total:
                    return pid, kid
    return None


def _epoch_in_new_process(url: str, opts: dict[str, Any], base: Path, key: str) -> tuple[list[int], int, str | None]:
    ds = StreamingDataset(url, storage_options=opts, cache=H.cache_config(base, ram="4MB"))
    ids, bad = H.check(ds, SIZE)
    where = ds.cache.contains(key)
    ds.close()
    ds.cache.close()
    return ids, bad, where


@pytest.mark.timeout(120)
def test_dataloader_worker_killed_mid_download(s3_server: Any, make_s3_url: Any, slowlink: Any,
                                              tmp_path: Path) -> None:
    url, n = make_s3_url(), 64
    m = H.write(url, s3_server.storage_options(), n, SIZE, shard_bytes=8 * SIZE)  # 8 shards of ~64 KB
    link = slowlink(bandwidth=128e3)  # half a second per shard
    opts = s3_server.storage_options(link.endpoint_url)
    # whole-shard downloads (the window), whose key locks and temp files this test follows; a
    # partial copy's fetcher killed mid-fill: tests/test_partial.py
    ds = StreamingDataset(url, storage_options=opts, cache=H.cache_config(tmp_path, ram="4MB"),
                          transfer=TransferConfig(part_bytes=8 * KB, concurrency=2), node_shuffle="never")
    cache = ds.cache
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    it = iter(loader)
    pids = {w.pid for w in it._workers}
    victim = H.wait_for(lambda: _worker_downloading(cache.lock_dir, data_dir(cache), pids, m.shards[0].bytes),
                        60, "a worker mid-download")
    os.kill(victim[0], signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"DataLoader worker .*(exited unexpectedly|killed by signal)") as info:
        for _ in it:
            pass
    traceback.clear_frames(info.value.__traceback__)  # free the iterator now, not in the cyclic GC
    del info, it, loader

    lock = KeyLock(cache.lock_dir, victim[1])
    assert lock.acquire(blocking=False), "the dead worker's key lock is stuck"
    lock.release()
    dead_key = next(k for k in map(ds.manifest.cache_key, range(len(m.shards))) if key_id(k) == victim[1])
    ids, bad, where = H.in_child(_epoch_in_new_process, url, opts, tmp_path, dead_key)
    assert bad == 0 and sorted(ids) == list(range(n))
    assert where == "ram"
    assert H.leftovers(data_dir(cache)) == []
    ds.close()
    cache.close()


# --------------------------------------------------------------------------- the training process dies
@pytest.mark.timeout(120)
def test_training_process_killed_while_writing_the_cache(s3_server: Any, make_s3_url: Any, slowlink: Any,
                                                         tmp_path: Path) -> None:
    url, n = make_s3_url(), 96
    m = H.write(url, s3_server.storage_options(), n, SIZE, shard_bytes=8 * SIZE)  # 12 shards of ~64 KB
    link = slowlink(bandwidth=256e3)
    spec = {"url": url, "opts": s3_server.storage_options(link.endpoint_url), "n": n, "size": SIZE,
            "cache": H.cache_kw(tmp_path, ram="4MB"), "transfer": {"part_bytes": 8 * KB, "concurrency": 2},
            "node_shuffle": "never"}  # whole-shard temp files, which this test watches being written
    ram_data = str(tmp_path / "ram" / "data")
    proc = subprocess.Popen([*H.COMMAND, json.dumps(spec)], cwd=H.ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    control = tmp_path / "ssd" / "control"
    index = Index(str(control))

    def committed_now() -> list[str]:  # entries in the index whose RAM file is in place
        if not (control / "index.lmdb").exists():
            return []
        with index.read() as txn:
            return [k for k, e in txn.items() if "ram" in e.tiers
                    and os.path.exists(os.path.join(ram_data, e.tiers["ram"]["file"]))]
    try:
        def mid_write() -> bool:  # some entries committed to the index, and one being written right now
            f = H.files(ram_data)
            return any(k.startswith(".tmp-") and v for k, v in f.items()) and bool(committed_now())

        def frozen_mid_write() -> bool:  # checked again with the process stopped: what the kill leaves
            if not mid_write():
                return False
            H.stop(proc.pid)
            if mid_write():
                return True
            os.kill(proc.pid, signal.SIGCONT)  # it renamed its temp file meanwhile: wait for the next
            return False
        H.wait_for(frozen_mid_write, 60, "the training process to be mid-write")
        proc.kill()
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    committed = committed_now()  # what the dead process had committed
    index.close()
    assert committed

    spec["opts"] = s3_server.storage_options()
    out = subprocess.run([*H.COMMAND, json.dumps(spec)], cwd=H.ROOT, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert "reconciled cache at" in out.stderr and res["reconciled"]["partial"] >= 1
    assert res["bad"] == 0 and sorted(res["ids"]) == list(range(n))
    st = res["stats"]
    assert st["corrupt"] == 0  # the survivors were re-hashed before being served, and all were whole
    assert st["hits_ram"] == len(committed)  # and served; everything else was fetched again
    assert st["fetches"] >= len(m.shards) - len(committed)
    assert H.leftovers(ram_data) == []


# --------------------------------------------------------------------------- a cached file rots
def _flip_a_byte(cache: NodeCache, key: str) -> str:
    entry = dict(cache.entries())[key]
    tier, rec = next(iter(entry.tiers.items()))
    path = cache.tiers[tier].file_path(rec["file"])
    with open(path, "r+b") as f:
        f.seek(entry.size // 2)
        b = f.read(1)
        f.seek(entry.size // 2)
        f.write(bytes([b[0] ^ 0x5A]))
    return path


@pytest.mark.timeout(120)
def test_threads_verifying_one_corrupt_entry_all_get_good_bytes(tmp_path: Path) -> None:
    """``verify="always"``: 8 threads get one entry whose file was corrupted on disk, all at once
    (a barrier), over 20 rounds. One of them drops the file and refetches; the others had pinned
    the same file before it was dropped, hash the file they hold (not its path, which may be gone
    by then) and refetch too. Every get returns the right bytes and no thread raises; hashing by
    path once raised FileNotFoundError here (a CI run of ``test_faults``)."""
    from datacache.hashing import hash_bytes

    data = os.urandom(1 << 20)
    cache = NodeCache(H.cache_config(tmp_path, ram="16MB", verify="always"))
    threads, barrier, errors, good = 8, threading.Barrier(8), [], []

    def get(round_: int) -> None:
        try:
            barrier.wait(timeout=30)
            with cache.get(f"k{round_}", lambda p: Path(p).write_bytes(data), size=len(data),
                           hash=hash_bytes(data)) as h:
                good.append(h.read() == data)
        except Exception:  # noqa: BLE001 - reported below with its traceback
            errors.append(traceback.format_exc())

    try:
        for round_ in range(20):
            with cache.get(f"k{round_}", lambda p: Path(p).write_bytes(data), size=len(data)) as h:
                assert h.read() == data
            _flip_a_byte(cache, f"k{round_}")
            workers = [threading.Thread(target=get, args=(round_,), name=f"verify-{i}") for i in range(threads)]
            for t in workers:
                t.start()
            for t in workers:
                t.join(timeout=60)
            assert not errors, errors[0]
        assert good == [True] * (20 * threads)
    finally:
        cache.close()


@pytest.mark.timeout(60)
def test_corrupt_cache_file_is_refetched_with_verify_always(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="datacache")
    url, n = f"file://{tmp_path}/ds", 80
    m = H.write(url, None, n, SIZE, shard_bytes=8 * SIZE)
    ds = StreamingDataset(url, cache=H.cache_config(tmp_path, ram="4MB", verify="always"))
    H.assert_exactly_once(ds, n, SIZE)
    path = _flip_a_byte(ds.cache, ds.manifest.cache_key(3))
    ds.set_epoch(1)
    H.assert_exactly_once(ds, n, SIZE)  # in the same process: hashed before every serve
    st = ds.stats()
    assert st["corrupt"] == 1 and st["fetches"] == len(m.shards) + 1
    assert not os.path.exists(path) and ds.cache.contains(ds.manifest.cache_key(3)) == "ram"
    assert len(H.warnings_with(caplog, "failed verification")) == 1
    ds.close()
    ds.cache.close()


@pytest.mark.timeout(90)
def test_corrupt_cache_file_is_refetched_after_a_restart(tmp_path: Path) -> None:
    url, n = f"file://{tmp_path}/ds", 80
    m = H.write(url, None, n, SIZE, shard_bytes=8 * SIZE)
    spec = {"url": url, "n": n, "size": SIZE, "cache": H.cache_kw(tmp_path, ram="4MB")}  # verify="first"
    ds = StreamingDataset(url, cache=CacheConfig(**spec["cache"]))
    H.assert_exactly_once(ds, n, SIZE)
    path = _flip_a_byte(ds.cache, ds.manifest.cache_key(5))
    before = ds.cache.stats()  # node-wide counters: the child's epoch adds to them
    ds.close()
    ds.cache.close()
    res = H.in_child(H.epoch_json, spec)  # a new process: a new verification token
    assert res["bad"] == 0 and sorted(res["ids"]) == list(range(n))
    st = {k: res["stats"][k] - before[k] for k in ("corrupt", "fetches", "hits_ram")}
    assert before["fetches"] == len(m.shards)
    # every other shard a hit (at least once each: the restarted epoch 0 keeps its first run's
    # decision, a part mix, whose chunks pin a shard once per chunk)
    assert st["corrupt"] == 1 and st["fetches"] == 1 and st["hits_ram"] >= len(m.shards) - 1, st
    assert not os.path.exists(path)


# --------------------------------------------------------------------------- the network misbehaves
FAULTS = {
    "503-every-4th": dict(fail_every=4),
    "reset-every-3rd": dict(reset_every=3),
    "latency-spikes": dict(latency_spike=(5, 1.5)),  # beyond the 0.5 s read timeout below
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_transient_faults_are_retried_and_the_epoch_is_exact(fault: str, s3_server: Any, make_s3_url: Any,
                                                            slowlink: Any, tmp_path: Path) -> None:
    url, n = make_s3_url(), 96
    m = H.write(url, s3_server.storage_options(), n, SIZE, shard_bytes=8 * SIZE)  # 12 shards of ~64 KB
    link = slowlink(**FAULTS[fault])
    ds = StreamingDataset(url, storage_options=s3_server.storage_options(link.endpoint_url),
                          cache=H.cache_config(tmp_path, ram="4MB"),
                          transfer=TransferConfig(part_bytes=16 * KB, concurrency=2, timeout=0.5),
                          retry=RetryConfig(attempts=12, base_delay=0.01, max_delay=0.1, deadline=30))
    got = list(DataLoader(ds, batch_size=None, num_workers=2))
    H.assert_exactly_once(got, n, SIZE)
    st = ds.stats()
    assert link.injected > 0 and st["storage_retries"] > 0
    assert st["fetches"] == len(m.shards) and st["remote_bytes"] == m.total_bytes  # each shard once
    ds.close()
    ds.cache.close()


# --------------------------------------------------------------------------- load
@pytest.mark.timeout(120)
def test_stress_tool_runs_clean_for_10_seconds() -> None:
    """tools/stress.py: 4 processes x 8 threads through one cache smaller than the data, every read
    checked byte for byte; the full 60 s run's figures are in README "Reliability"."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "tools" / "stress.py"), "--seconds", "10"],
                         capture_output=True, text=True, timeout=100, cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "errors: 0" in out.stdout.splitlines() and "reads/s" in out.stdout
    reads = int(next(line for line in out.stdout.splitlines() if line.startswith("reads:")).split()[1])
    fetches = int(next(line for line in out.stdout.splitlines() if line.startswith("fetches:")).split()[1])
    assert reads > 0 and fetches > 64  # budgets below the data: keys were evicted and fetched again
