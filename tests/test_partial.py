"""Partial copies (``datacache.cache.partial`` through ``ShardSource.load_rows``): a shard filled block by
block by the node's processes, readable before it is whole, verified and cached once it is.

Real S3 server, real processes (forked), bytes counted by each process's store. Multi-process
tests wait on events and carry a timeout mark: a deadlock fails instead of hanging.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from typing import Any

import numpy as np
import pytest

from datacache import CacheConfig, IntegrityError
from datacache._localfs import key_id
from datacache.cache.partial import PartialShard
from datacache.plan.part_shuffle import part_rows
from datacache.read.shard_source import PartHandle, ShardSource
from datacache.readers._dczindex import dcz_layout
from tests.helpers import faults as H

SIZE, N, SHARD = 1000, 300, 100_000  # about 100 samples per shard, 4 samples a block
WRITER = {"block_bytes": 4 * 1024}


@pytest.fixture
def blocky(s3_server: Any, make_s3_url: Any) -> tuple[str, dict[str, Any]]:
    """A dataset whose shards hold about 25 blocks each (so parts of a shard are a few blocks)."""
    url, opts = make_s3_url(), s3_server.storage_options()
    H.write(url, opts, N, SIZE, shard_bytes=SHARD, writer_options=WRITER)
    return url, opts


def _source(url: str, opts: dict[str, Any], root: str) -> ShardSource:
    cfg = CacheConfig(ram_bytes=0, ssd_bytes="64MB", ram_dir=os.path.join(root, "ram"),
                      ssd_dir=os.path.join(root, "ssd"))
    return ShardSource.open(url, storage_options=opts, cache=cfg)


def _check(src: ShardSource, shard: int, handle: Any, lo: int, hi: int) -> None:
    first = src.manifest.offsets[shard]
    got = src.read_rows(shard, handle, range(lo, hi))
    assert sorted(got) == list(range(lo, hi))
    for r, s in got.items():
        assert int(s["i"]) == first + r and bytes(s["data"]) == H.payload(first + r, SIZE)


def _read(src: ShardSource) -> int:
    return int(src.store.stats()["bytes_read"])


def test_a_partial_copy_serves_samples_before_it_is_whole_then_becomes_the_entry(blocky, tmp_path) -> None:
    src = _source(*blocky, str(tmp_path))
    try:
        n, size = src.manifest.shards[0].samples, src.manifest.shards[0].bytes
        handle = src.load_rows(0, range(8, 16))
        assert isinstance(handle, PartHandle)
        _check(src, 0, handle, 8, 16)
        assert src.cache.contains(src.key(0)) is None  # nothing visible before the whole file passed
        assert _read(src) < size / 2  # the tail (index) and two blocks, not the shard
        parts = [(lo, min(lo + 8, n)) for lo in range(0, n, 8) if lo != 8]
        for lo, hi in parts[:-1]:
            _check(src, 0, src.load_rows(0, range(lo, hi)), lo, hi)
        last = src.load_rows(0, range(*parts[-1]))
        assert not isinstance(last, PartHandle)  # the last unit in: verified, now the entry
        _check(src, 0, last, *parts[-1])
        last.release()
        assert src.cache.contains(src.key(0)) == "ssd"
        stats = src.cache.stats()
        assert stats["fetches"] == 1 and stats["remote_bytes"] == size
        # every byte once, but for the part of the tail read that the index's first unit re-reads
        assert size <= _read(src) <= size + WRITER["block_bytes"] * 2
        locks = os.listdir(src.cache.lock_dir)  # the copy's state and unit locks went with it
        assert not [f for f in locks if f.endswith(".part") or (".u" in f and not f.endswith(".u0.lock"))], locks
        again = src.load_rows(0, range(0, 4))  # cached now: a hit, no transfer
        assert not isinstance(again, PartHandle)
        again.release()
    finally:
        src.close()


def test_an_index_longer_than_the_first_read_tail_is_fetched_once(s3_server, make_s3_url, tmp_path) -> None:
    """A shard of 3,000 small samples has a 50 KB index, more than the 16 KiB tail its partial
    copy's first read gets: the rest of the index is one more read, and no byte comes twice (the
    index was read again with its footer, a third round trip before the first block)."""
    url, opts = make_s3_url(), s3_server.storage_options()
    H.write(url, opts, 3000, 40, shard_bytes=1 << 20, writer_options=WRITER)
    src = _source(url, opts, str(tmp_path))
    try:
        name, size = src.manifest.shards[0].name, src.manifest.shards[0].bytes
        before = _read(src), int(src.store.stats()["requests"])  # the manifest's
        handle = src.load_rows(0, [5])
        sample = src.read_rows(0, handle, [5])[5]
        assert int(sample["i"]) == 5 and bytes(sample["data"]) == H.payload(5, 40)
        got, requests = _read(src) - before[0], int(src.store.stats()["requests"]) - before[1]
        layout = dcz_layout(lambda a, b: src.store.read_range(name, a, b), size, name)
        index = size - layout.fixed[-1][0]
        assert index > 16 << 10, "the index is longer than the first read's tail"
        block = max(b - a for a, b in layout.spans)
        assert got <= index + 4096 + 2 * block, f"{got} bytes for a {index}-byte index and one block"
        assert requests <= 4, f"{requests} requests: head and tail, the rest of the index, one block"
    finally:
        src.close()


def _child(url: str, opts: dict[str, Any], root: str, ranges: list[tuple[int, int]], go: Any,
           out: Any) -> None:
    src = _source(url, opts, root)
    try:
        go.wait(60)
        for lo, hi in ranges:
            handle = src.load_rows(0, range(lo, hi))
            _check(src, 0, handle, lo, hi)
            handle.release()
        out.put(("ok", _read(src)))
    except BaseException as exc:  # reported to the test, with its type
        out.put(("error", repr(exc)))
    finally:
        src.close()


@pytest.mark.timeout(120)
def test_processes_fill_one_copy_fetching_each_block_once(blocky, tmp_path) -> None:
    url, opts = blocky
    root = str(tmp_path)
    probe = _source(url, opts, root)
    n, size = probe.manifest.shards[0].samples, probe.manifest.shards[0].bytes
    probe.close()
    ctx = mp.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    # overlapping orders: every block is wanted by two processes, and each reads all of its samples
    plans = [[(lo, min(lo + 6, n)) for lo in range(0, n, 6)],
             [(lo, min(lo + 5, n)) for lo in reversed(range(0, n, 5))],
             [(lo, min(lo + 7, n)) for lo in range(3, n, 7)]]
    procs = [ctx.Process(target=_child, args=(url, opts, root, p, go, out)) for p in plans]
    for p in procs:
        p.start()
    go.set()
    results = [out.get(timeout=100) for _ in procs]
    for p in procs:
        p.join(30)
    assert [r[0] for r in results] == ["ok"] * 3, results
    total = sum(r[1] for r in results)
    # one download per block per node
    assert size <= total <= size + WRITER["block_bytes"] * 2, (total, size)
    src = _source(url, opts, root)
    try:
        assert src.cache.contains(src.key(0)) == "ssd"
        assert src.cache.stats()["fetches"] == 1
    finally:
        src.close()


def _stuck_child(url: str, opts: dict[str, Any], root: str, filled: Any) -> None:
    src = _source(url, opts, root)
    info = src.manifest.shards[0]
    partial = PartialShard(src.cache, src.key(0), size=info.bytes, digest=info.hash, samples=info.samples,
                           layout_of=src.fmt.layout, name=src.url(0))
    calls = []

    def fetch(start: int, end: int) -> bytes:
        calls.append(start)
        if len(calls) > 4:  # the fixed ranges and two parts are in: hold the next unit's lock forever
            filled.set()
            signal.pause()
        return src.store.read_range(info.name, start, end)
    partial.ensure(list(range(0, 8)), fetch)
    partial.ensure(list(range(8, 16)), fetch)
    partial.ensure(list(range(16, 24)), fetch)


@pytest.mark.timeout(120)
def test_a_fetcher_killed_mid_fill_leaves_no_entry_and_the_next_one_continues(blocky, tmp_path) -> None:
    url, opts = blocky
    root = str(tmp_path)
    ctx = mp.get_context("fork")
    filled = ctx.Event()
    child = ctx.Process(target=_stuck_child, args=(url, opts, root, filled))
    child.start()
    assert filled.wait(60)
    src = _source(url, opts, root)  # joins the node while the child lives: no reconciliation after it
    os.kill(child.pid, signal.SIGKILL)  # dies holding a unit's lock, mid-fill
    child.join(30)
    try:
        n, size = src.manifest.shards[0].samples, src.manifest.shards[0].bytes
        assert src.cache.contains(src.key(0)) is None
        for lo in range(0, n, 10):
            handle = src.load_rows(0, range(lo, min(lo + 10, n)))
            _check(src, 0, handle, lo, min(lo + 10, n))
            handle.release()
        assert src.cache.contains(src.key(0)) == "ssd"
        assert _read(src) < size  # the units the dead process had filled were not fetched again
    finally:
        src.close()


def test_a_copy_that_fails_the_hash_is_dropped_and_never_cached(blocky, tmp_path) -> None:
    src = _source(*blocky, str(tmp_path))
    try:
        info = src.manifest.shards[0]
        partial = PartialShard(src.cache, src.key(0), size=info.bytes, digest="0" * 32, samples=info.samples,
                               layout_of=src.fmt.layout, name=src.url(0))

        def fetch(start: int, end: int) -> bytes:
            return src.store.read_range(info.name, start, end)
        assert partial.ensure(list(range(8)), fetch) is False
        with pytest.raises(IntegrityError, match="content hash"):
            partial.ensure(list(range(info.samples)), fetch)
        partial.close()
        assert src.cache.contains(src.key(0)) is None
        leftovers = [f for d, _, fs in os.walk(str(tmp_path)) for f in fs if f.endswith(".part")]
        assert leftovers == []
        handle = src.load_rows(0, range(0, 8))  # a new copy starts over, and this one is whole and right
        _check(src, 0, handle, 0, 8)
    finally:
        src.close()


def test_a_format_without_a_layout_is_fetched_whole(s3_server, make_s3_url, tmp_path) -> None:
    url, opts = make_s3_url(), s3_server.storage_options()
    H.write(url, opts, 40, SIZE, shard_bytes=10_000, format="parquet")
    src = _source(url, opts, str(tmp_path))
    try:
        handle = src.load_rows(1, range(2, 5))
        assert not isinstance(handle, PartHandle)
        assert src.cache.contains(src.key(1)) == "ssd"
        _check(src, 1, handle, 2, 5)
        handle.release()
    finally:
        src.close()


def test_parts_are_cut_along_the_blocks_the_writer_recorded(blocky, tmp_path) -> None:
    """The writer records its samples per block; the part mix cuts parts at multiples of it, so a
    part of about k blocks' bytes is k whole blocks (k ranged reads' worth, not k + 1 part blocks)."""
    src = _source(*blocky, str(tmp_path))
    try:
        m = src.manifest
        layouts = [dcz_layout(lambda a, b, s=s: src.store.read_range(s.name, a, b), s.bytes, s.name)
                   for s in m.shards]
        sizes = [b - a for lay in layouts for a, b in zip(lay.first[:-1], lay.first[1:])]
        assert m.unit_rows == sorted(sizes)[(len(sizes) - 1) // 2] and m.unit_rows > 1
        shard_bytes = np.array([s.bytes for s in m.shards])
        counts = np.array([s.samples for s in m.shards])
        block = float(shard_bytes.sum()) / counts.sum() * m.unit_rows
        rows = part_rows(int(2.4 * block), shard_bytes, counts, m.unit_rows)
        assert rows == 2 * m.unit_rows
        for lay in layouts:  # every part but a shard's last one spans exactly two blocks
            for lo in range(0, lay.samples - rows, rows):
                assert len(lay.units_of_rows(list(range(lo, lo + rows)))) == 2
        assert part_rows(int(2.4 * block), shard_bytes, counts) == int(2.4 * block // (block / m.unit_rows))
    finally:
        src.close()


def _lock_waited(path: str) -> bool:
    """Whether a thread waits for the ``flock`` on ``path`` now (a "->" line of ``/proc/locks``)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as f:
        return any("->" in line and dev in line.split() for line in f)


@pytest.mark.timeout(60)
def test_a_stale_state_is_never_paired_with_a_new_copy_being_created(blocky, tmp_path) -> None:
    """A copy's state and scratch file are one unit. The restart race of issue 37: after a
    reconciliation removed a copy's scratch file, one process reads the copy's stale state while
    another, holding ``u0``, creates a new copy (sparse until its fixed ranges are in). The first
    must not pair the stale state with the new file ("no footer magic", or zeros where the stale
    state marks units filled): it waits for the new copy, and serves every byte right."""
    src = _source(*blocky, str(tmp_path))
    try:
        info = src.manifest.shards[0]

        def handle() -> PartialShard:
            return PartialShard(src.cache, src.key(0), size=info.bytes, digest=info.hash, samples=info.samples,
                                layout_of=src.fmt.layout, name=src.url(0))

        def fetch(start: int, end: int) -> bytes:
            return src.store.read_range(info.name, start, end)
        old = handle()
        assert old.ensure(list(range(16)), fetch) is False  # units filled: state and scratch file on disk
        state_path = os.path.join(src.cache.lock_dir, f"{key_id(src.key(0))}.part")
        stale = open(state_path, "rb").read()
        old.close()
        os.unlink(old.path)  # what reconciliation did to the scratch file

        creating, go = threading.Event(), threading.Event()

        def slow(start: int, end: int) -> bytes:  # the creator's first reads wait: its new file is sparse
            creating.set()
            assert go.wait(30)
            return fetch(start, end)
        results: dict[str, Any] = {}

        def run(name: str, h: PartialShard, f: Any) -> None:
            try:
                h.ensure(list(range(16)), f)
                results[name] = h.path
            except BaseException as exc:
                results[name] = exc
        creator, reader = handle(), handle()
        a = threading.Thread(target=run, args=("creator", creator, slow))
        a.start()
        assert creating.wait(30)
        with open(state_path, "wb") as f:  # the stale state, as the other process read it just before
            f.write(stale)
        b = threading.Thread(target=run, args=("reader", reader, fetch))
        b.start()
        u0 = os.path.join(src.cache.lock_dir, f"{key_id(src.key(0))}.u0.lock")
        H.wait_for(lambda: "reader" in results or _lock_waited(u0), 30, "the reader to wait for the new copy")
        go.set()
        a.join(30)
        b.join(30)
        assert not isinstance(results.get("reader"), BaseException), results
        assert not isinstance(results.get("creator"), BaseException), results
        for h in (creator, reader):
            _check(src, 0, PartHandle(h.path), 0, 16)
            h.close()
    finally:
        src.close()
