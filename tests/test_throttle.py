"""Throttling (issue 16): a store that answers "slow down" is survived, the node backs off as one,
and a permanently throttled store ends in one clear, bounded error. A real S3 server (SeaweedFS)
behind tools/slowlink.py, whose throttle window cuts every open connection and answers every
request with 503 SlowDown for a while; requests are counted at the proxy. No wall-clock
assertions: counts, and completion within each test's hang guard.
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from datacache import (
    RetryConfig,
    StreamingDataset,
    ThrottledError,
    TransferConfig,
    TransientStorageError,
    open_store,
)
from datacache.store.congestion import Congestion
from tests.helpers import faults as H

KB = 1 << 10
SIZE = 8 * KB
STORM = 15.0  # seconds: twice what the old 6 attempts outlived (7.3 s); the 60 s figure is a bench run
CALM_AFTER = 5.0  # the node's request rate is judged after the storm's first 5 s
FORK = mp.get_context("fork")


def late_requests(link: Any) -> int:
    """Requests the proxy answered with 503 after the first CALM_AFTER seconds of its window."""
    return sum(t >= CALM_AFTER for t in list(link.throttled_at))


@pytest.mark.timeout(300)
def test_mid_epoch_storm_over_dataloader_workers_is_survived_exactly_once(s3_server: Any, make_s3_url: Any,
                                                                          slowlink: Any, tmp_path: Path) -> None:
    url, n = make_s3_url(), 320
    m = H.write(url, s3_server.storage_options(), n, SIZE, shard_bytes=8 * SIZE)  # 40 shards of ~64 KB
    link = slowlink(bandwidth=512e3, latency=0.02)  # ~5 s of downloads: the storm lands mid-epoch
    ds = StreamingDataset(url, storage_options=s3_server.storage_options(link.endpoint_url),
                          cache=H.cache_config(tmp_path, ram="8MB"), transfer=TransferConfig(part_bytes=16 * KB))
    it = iter(DataLoader(ds, batch_size=None, num_workers=2))  # RetryConfig() defaults
    got = [next(it)]
    link.throttle(STORM)
    got += list(it)
    assert not link.throttling, "the epoch ended inside the storm: it did not land mid-epoch"
    H.assert_exactly_once(got, n, SIZE)
    st = ds.stats()
    assert len(link.throttled_at) > 0 and st["storage_throttled"] > 0  # the workers' counts, node-wide
    assert st["storage_throttle_seconds"] > 0 and st["storage_concurrency"] >= 1
    assert late_requests(link) <= 2 * (STORM - CALM_AFTER), "the node kept pressing on a throttling store"
    assert st["fetches"] == len(m.shards) and st["remote_bytes"] == m.total_bytes and st["corrupt"] == 0
    assert H.leftovers(ds.cache.tiers["ram"].data_dir) == []
    ds.close()
    ds.cache.close()
    # `datacache stat` shows the node's congestion state for this prefix
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATACACHE_", "AWS_"))}
    env.update(DATACACHE_RAM_DIR=str(tmp_path / "ram"), DATACACHE_SSD_DIR=str(tmp_path / "ssd"),
               DATACACHE_SSD_BYTES="0", PYTHONPATH=str(H.ROOT))
    out = subprocess.run([sys.executable, "-m", "datacache.cli", "stat", "--json", "--quiet"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=H.ROOT)
    assert out.returncode == 0, out.stderr
    (store,) = json.loads(out.stdout)["stores"]
    assert store["url"] == url and store["throttled"] == st["storage_throttled"]
    assert store["throttle_seconds"] >= st["storage_throttle_seconds"] and store["concurrency"] >= 1
    text = subprocess.run([sys.executable, "-m", "datacache.cli", "stat"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=H.ROOT).stdout
    assert f"store {url}: concurrency" in text and f"{store['throttled']} throttled" in text


@pytest.mark.timeout(120)
def test_store_throttled_for_good_gives_one_clear_error_within_the_deadline(s3_server: Any, make_s3_url: Any,
                                                                           slowlink: Any, tmp_path: Path) -> None:
    url, n = make_s3_url(), 64
    m = H.write(url, s3_server.storage_options(), n, SIZE, shard_bytes=8 * SIZE)
    link = slowlink()
    ds = StreamingDataset(url, storage_options=s3_server.storage_options(link.endpoint_url),
                          cache=H.cache_config(tmp_path, ram="4MB"), retry=RetryConfig(deadline=3.0))
    link.throttle(3600)  # throttled for good
    with pytest.raises(ThrottledError) as info:
        for _ in ds:
            pass
    err = info.value
    assert isinstance(err, TransientStorageError) and err.__cause__ is not None
    assert err.url.startswith(url) and err.url.endswith(tuple(s.name for s in m.shards))
    text = str(err)
    assert err.url in text and "throttling" in text and "max_requests_per_s" in text and "SlowDown" in text
    # the node backed off: a few requests over the 3 s deadline, not one every few milliseconds
    assert 0 < len(link.throttled_at) <= 30
    assert ds.cache.entries() == [] and H.leftovers(ds.cache.tiers["ram"].data_dir) == []
    ds.close()
    ds.cache.close()


def _read_until_served(url: str, opts: dict[str, Any], control_dir: str, threads: int, q: Any,
                       ready: Any, go: Any) -> None:
    """A process of the node: ``threads`` threads each read one range until the store serves it.
    One read before the storm (its S3 client made), then ``ready``, and the threads start at ``go``."""
    store = open_store(url, opts, retry=RetryConfig(deadline=120))
    store.share_congestion(control_dir)
    store.read_range("o.bin", 0, 100)
    ready.wait()
    go.wait()
    errors: list[str] = []

    def one() -> None:
        try:
            store.read_range("o.bin", 0, 100)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(repr(exc))
    ts = [threading.Thread(target=one, name=f"reader-{i}") for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    q.put((os.getpid(), errors, store.stats()))
    store.close()


@pytest.mark.timeout(180)
def test_node_request_rate_falls_during_a_storm_across_processes(s3_server: Any, make_s3_url: Any,
                                                                slowlink: Any, tmp_path: Path) -> None:
    url, procs, threads, storm = make_s3_url(), 8, 2, 12.0
    open_store(url, s3_server.storage_options()).write_bytes("o.bin", os.urandom(1000))
    link = slowlink(latency=0.01)
    control = str(tmp_path / "control")
    os.makedirs(control, mode=0o700)
    q, ready, go = FORK.Queue(), FORK.Barrier(procs + 1), FORK.Event()
    ps = [FORK.Process(target=_read_until_served, args=(url, s3_server.storage_options(link.endpoint_url), control,
                                                        threads, q, ready, go), daemon=True) for _ in range(procs)]
    for p in ps:
        p.start()
    ready.wait(timeout=150)  # every process started, its client made (a slow start is not a calm storm)
    link.throttle(storm)
    go.set()
    results = [q.get(timeout=150) for _ in ps]
    for p in ps:
        p.join(30)
    assert all(errors == [] for _, errors, _ in results), results  # every reader outlived the storm
    assert not link.throttling
    # 16 readers in 8 processes; one node: after 5 s, on average at most 2 requests per second
    assert late_requests(link) <= 2 * (storm - CALM_AFTER), sorted(link.throttled_at)
    node = Congestion(url, control).stats()
    failed = Counter()  # the processes' failed attempts by error class: what a count that differs was seen as
    for _, _, st in results:
        failed.update(st["errors"])
    # every process counted into one state
    assert node["throttled"] == len(link.throttled_at), (node, len(link.throttled_at), dict(failed))
    assert node["in_flight"] == 0 and node["requests"] >= procs * threads


def _spend(url: str, opts: dict[str, Any], control: str, rate: float, count: int, q: Any) -> None:
    """A process of the node making ``count`` requests under the node's ``rate`` budget."""
    store = open_store(url, opts, transfer=TransferConfig(max_requests_per_s=rate))
    store.share_congestion(control)
    for _ in range(count):
        store.read_range("o.bin", 0, 10)
    q.put(os.getpid())
    store.close()


@pytest.mark.timeout(120)
def test_request_budget_is_kept_by_every_process_of_the_node_together(s3_server: Any, make_s3_url: Any,
                                                                      slowlink: Any, tmp_path: Path) -> None:
    url, rate, procs, count = make_s3_url(), 8.0, 3, 12
    open_store(url, s3_server.storage_options()).write_bytes("o.bin", b"x" * 100)
    link = slowlink()
    control = str(tmp_path / "control")
    q = FORK.Queue()
    t0 = time.monotonic()
    ps = [FORK.Process(target=_spend, args=(url, s3_server.storage_options(link.endpoint_url), control, rate, count, q),
                       daemon=True) for _ in range(procs)]
    for p in ps:
        p.start()
    for _ in ps:
        q.get(timeout=100)
    spent = time.monotonic() - t0
    for p in ps:
        p.join(30)
    assert link.requests == procs * count
    # a token bucket one second deep, shared: never more than rate/s plus its depth over the run
    # (one bucket per process would let 3 x 8/s through: 36 requests in about a second)
    assert link.requests <= rate * spent + rate


@pytest.mark.timeout(60)
def test_window_halves_on_throttling_grows_on_success_and_a_killed_holder_is_forgotten(tmp_path: Path) -> None:
    c = Congestion("s3://b/p/", str(tmp_path), base_delay=0.001, max_delay=0.001)
    assert c.acquire(time.monotonic() + 30)
    c.release("throttled")
    assert c.stats()["concurrency"] == 64 and c.stats()["throttled"] == 1
    for _ in range(12):
        assert c.acquire(time.monotonic() + 30)
        c.release("throttled")
    assert c.stats()["concurrency"] == 1  # never below one request in flight
    assert c.acquire(time.monotonic() + 30)
    c.release("ok")
    st = c.stats()
    assert st["concurrency"] == 2 and st["requests"] == 14 and st["in_flight"] == 0 and st["throttle_seconds"] > 0
    assert c.acquire(time.monotonic() + 30)
    c.release("throttled")  # back to a window of one
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a process of the node that dies mid-request, holding the only place
        try:
            Congestion("s3://b/p/", str(tmp_path)).acquire(time.monotonic() + 30)
            os.write(w, b"x")
            time.sleep(60)
        finally:
            os._exit(0)
    assert os.read(r, 1) == b"x"
    assert c.stats()["in_flight"] == 1
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    assert c.acquire(time.monotonic() + 30)  # the dead holder's place is taken back
    c.release("ok")
    assert c.stats()["in_flight"] == 0
    c.close()
    c.close()


class _SlowDown(Exception):
    def __init__(self) -> None:
        super().__init__("An error occurred (SlowDown)")
        self.response = {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}


def test_a_long_outage_is_reported_while_it_is_retried(caplog: Any) -> None:
    from datacache.store import retry as _retry

    def throttled() -> None:
        raise _SlowDown()
    caplog.set_level(logging.WARNING, logger="datacache.store.storage")
    _retry._last_warning[0] = float("-inf")
    with pytest.raises(ThrottledError, match="2 attempts"):  # began 20 s ago: past the warning period
        _retry.retry_call(throttled, RetryConfig(attempts=2), url="s3://b/p/x", op="read", redact=str,
                          started=time.monotonic() - 20)
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "s3://b/p/x" in rec.getMessage() and "throttling" in rec.getMessage()
    assert "RetryConfig.deadline=600" in rec.getMessage()


def test_a_throttled_error_names_the_throttling_answer_whatever_failed_last() -> None:
    """The node's gate ends a throttled operation (``NodeBackoff``): its error names the store's
    last throttling answer (503 SlowDown) even where a later attempt failed otherwise (a timeout
    on a busy machine), so that the user reads why."""
    from datacache.store import retry as _retry

    answers = iter([_SlowDown(), TimeoutError("read timed out"),
                    _retry.NodeBackoff("the gate's wait is past the deadline")])

    def fn() -> None:
        raise next(answers)
    with pytest.raises(ThrottledError) as info:
        _retry.retry_call(fn, RetryConfig(deadline=600), url="s3://b/p/x", op="read", redact=str,
                          sleep=lambda _: None)
    assert "SlowDown" in str(info.value) and "throttling" in str(info.value), str(info.value)
    assert isinstance(info.value.__cause__, _SlowDown)


def test_a_request_the_gate_turns_away_first_names_the_answer_that_moved_it() -> None:
    """Another thread's request had the throttling answer that moved the node's gate past this
    operation's deadline, so this one's first attempt never left (``NodeBackoff``): its error still
    names the store's answer (503 SlowDown), not only the gate."""
    from datacache.store import retry as _retry

    c = Congestion("s3://b/p/", None, base_delay=60, max_delay=60)
    with pytest.raises(_SlowDown):
        with c.request(time.monotonic() + 30):  # the other thread's request: the gate moves 30-60 s ahead
            raise _SlowDown()

    def fn() -> None:
        with c.request(time.monotonic() + 1):
            pass
    with pytest.raises(ThrottledError) as info:
        _retry.retry_call(fn, RetryConfig(deadline=1), url="s3://b/p/x", op="read", redact=str)
    assert "SlowDown" in str(info.value) and "1 attempt" in str(info.value), str(info.value)
    c.close()
