"""The Prefetcher primitive: order, back-pressure, adaptation, errors with tracebacks, shutdown;
and the dataset-level promise that a consumer slower than its link waits only for the first shard."""
from __future__ import annotations

import threading
import time
import traceback

import numpy as np
import pytest

from datacache import CacheConfig, PrefetchConfig, StreamingDataset, write_dataset
from datacache.read.prefetch import Prefetcher
from tests.helpers import faults as H


def test_results_come_in_order_whatever_the_completion_order() -> None:
    rng = np.random.default_rng(0)
    delays = rng.random(40) * 0.005
    p = Prefetcher(range(40), lambda i: (time.sleep(delays[i]), i * i)[1],
                   config=PrefetchConfig(threads=4, lookahead_bytes=8, adaptive=False))
    assert list(p) == [i * i for i in range(40)]
    p.close()


def test_back_pressure_bounds_started_but_untaken_bytes() -> None:
    """Invariant: bytes started and not yet taken <= lookahead, except the consumer's next item."""
    lock = threading.Lock()
    started: list[int] = []
    taken = [0]
    worst = [0]
    sizes = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3] * 3

    def load(i: int) -> int:
        with lock:
            started.append(i)
            outstanding = sum(sizes[j] for j in started if j >= taken[0])
            if len(started) - 1 > taken[0]:  # not only the consumer's next item
                worst[0] = max(worst[0], outstanding)
        return i

    p = Prefetcher(range(len(sizes)), load, size_of=lambda i: sizes[i],
                   config=PrefetchConfig(threads=4, lookahead_bytes=10, max_lookahead_bytes=10, adaptive=False))
    for i in range(len(sizes)):
        time.sleep(0.002)  # a slow consumer: the pool runs as far ahead as the budget allows
        assert p.take() == i
        with lock:
            taken[0] = i + 1
    assert worst[0] <= 10
    p.close()


def test_an_item_bigger_than_the_budget_still_flows() -> None:
    p = Prefetcher(range(5), lambda i: i, size_of=lambda i: 100,
                   config=PrefetchConfig(threads=2, lookahead_bytes=10, max_lookahead_bytes=10, adaptive=False))
    assert list(p) == list(range(5))


def test_waiting_consumer_raises_concurrency_and_calm_one_lowers_it() -> None:
    cfg = PrefetchConfig(threads=1, max_threads=6, lookahead_bytes=2, max_lookahead_bytes=20)
    gates = [threading.Event() for _ in range(12)]

    def held(i: int) -> int:  # each item is loaded only once the consumer is already waiting for it
        gates[i].wait(10)
        return i

    slow = Prefetcher(range(12), held, size_of=lambda i: 1, config=cfg)

    def release_once_waited(i: int) -> None:
        H.wait_for(lambda: slow._ready._waiters, 30, f"the consumer to wait for item {i}")  # a hang guard
        time.sleep(0.005)  # the consumer is blocked: it waits at least this long (a wait is > 1 ms)
        gates[i].set()

    for i in range(12):
        threading.Thread(target=release_once_waited, args=(i,), name=f"tgate-{i}").start()
        assert slow.take() == i
    assert slow.waits > 0 and slow.active_threads > 1 and slow.lookahead > 2
    ready = [threading.Event() for _ in range(200)]

    def instant(i: int) -> int:
        ready[i].set()
        return i

    fast = Prefetcher(range(200), instant, size_of=lambda i: 1, config=cfg)
    fast._active, fast.lookahead = 6, 20  # as if it had grown
    for i in range(200):  # the consumer is the bottleneck: its next result is stored before it asks
        assert ready[i].wait(10)
        with fast._ready:
            assert fast._ready.wait_for(lambda i=i: i in fast._results, 10)
        assert fast.take() == i
    assert fast.waits == 0
    assert fast.active_threads == cfg.threads and fast.lookahead == cfg.lookahead_bytes
    slow.close()
    fast.close()


def test_load_error_reaches_the_consumer_with_its_traceback() -> None:
    def load(i: int) -> int:
        if i == 3:
            raise KeyError("boom at 3")
        return i

    p = Prefetcher(range(6), load, config=PrefetchConfig(threads=3, adaptive=False), name="tprefetch")
    got = [p.take() for _ in range(3)]
    with pytest.raises(KeyError, match="boom at 3") as info:
        p.take()
    assert got == [0, 1, 2]
    frames = "".join(traceback.format_tb(info.value.__traceback__))
    assert "in load" in frames  # the prefetch thread's frame is in the traceback
    p.close()


def test_close_is_idempotent_releases_results_and_never_hangs() -> None:
    released: list[int] = []
    gate = threading.Event()
    first_four = threading.Barrier(4 + 1)  # items 0-3 loaded, and the test

    blocked = threading.Event()

    def load(i: int) -> int:
        if i >= 4:
            blocked.set()
            gate.wait(5)
        else:
            first_four.wait(10)
        return i

    p = Prefetcher(range(50), load, release=released.append,
                   config=PrefetchConfig(threads=4, lookahead_bytes=8, adaptive=False, slow_start=False),
                   name="tclose")  # items 0-3 load together, so no slow start
    first_four.wait(10)  # items 0-3 are loaded (their results follow at once); 4+ block on the gate
    assert p.take() == 0
    assert blocked.wait(10)  # a thread is inside the load of item 4+
    t0 = time.monotonic()
    p.close(timeout=1.0)
    p.close()
    gate.set()
    assert time.monotonic() - t0 < 30  # a hang guard: close waits at most its timeout for blocked loads
    assert set(released) <= set(range(1, 50)) and {1, 2, 3} <= set(released)
    assert all(t.name.startswith("tclose-") for t in p._threads)
    with pytest.raises(RuntimeError):
        p.take()


@pytest.mark.timeout(120)
def test_consumer_slower_than_its_link_waits_only_for_the_first_shard(tmp_path, s3_server, slowlink) -> None:
    """The prefetcher runs ahead of a slow consumer on its own: while the consumer still reads shard
    ``j``, shard ``j + 1`` crosses the link, so only the first shard is waited for. Counted in bytes
    at the proxy (was: zero waits by the clock, with a 2 ms sleep per sample as the slow consumer)."""
    url = f"s3://{s3_server.bucket}/prefetch-{tmp_path.name}/"
    rng = np.random.default_rng(0)  # incompressible: ~1 MB shards
    samples = ({"i": i, "x": rng.integers(0, 256, 16_000, dtype=np.uint8)} for i in range(640))
    m = write_dataset(samples, url, storage_options=s3_server.storage_options(), shard_bytes=1_000_000, progress=False)
    link = slowlink(bandwidth=100e6, latency=0.002)
    cfg = CacheConfig(ram_bytes="64MB", ssd_bytes=0, ram_dir=str(tmp_path / "ram"), ssd_dir=str(tmp_path / "ssd"))
    ds = StreamingDataset(url, storage_options=s3_server.storage_options(link.endpoint_url), cache=cfg, shuffle=False)
    assert len(m.shards) >= 8
    ends = np.cumsum([s.samples for s in m.shards])  # the consumer is in shard j until sample ends[j]
    through = np.cumsum([s.bytes for s in m.shards])  # bytes of shards 0..j
    base = link.bytes_down  # the manifest
    got = []
    for sample in ds:
        j = int(np.searchsorted(ends, len(got), side="right"))
        if j + 1 < len(m.shards):  # a slow consumer: it stays in shard j until shard j + 1 has arrived
            H.wait_for(lambda j=j: link.bytes_down - base >= through[j + 1], 60,
                       f"shard {j + 1} while reading shard {j}")
        got.append(int(sample["i"]))
    assert got == list(range(640))
    assert m.total_bytes <= link.bytes_down - base <= 1.05 * m.total_bytes
    ds.close()


@pytest.mark.parametrize("slow_start", [True, False])
def test_slow_start_gives_the_first_item_the_link_to_itself(slow_start: bool) -> None:
    """With ``slow_start`` no item starts before the first has loaded (a cold epoch's first shard
    does not share the link with the lookahead); without it the lookahead starts at once. Item 0
    waits (bounded) for item 1 to start, so the order of the two events tells which happened."""
    log: list[str] = []
    lock = threading.Lock()
    one_started = threading.Event()

    def load(i: int) -> int:
        if i == 0:
            one_started.wait(timeout=0.5)  # only ever waits the timeout out when slow start holds
        with lock:
            log.append(f"{i}-{'end' if i == 0 else 'start'}")
        if i == 1:
            one_started.set()
        return i

    p = Prefetcher(range(6), load, config=PrefetchConfig(threads=4, lookahead_bytes=8, adaptive=False,
                                                         slow_start=slow_start))
    assert list(p) == list(range(6))
    p.close()
    first, second = log.index("0-end"), log.index("1-start")
    assert (first < second) if slow_start else (second < first), log
