"""The warm read path: raw blocks read in place, uniform blocks decoded at once, pooled buffers,
readers kept open across runs, and batches in shared-memory rings (datacache.pytorch.batches)."""
from __future__ import annotations

import gc
import mmap
import multiprocessing
import os
import re
import resource
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from datacache import NodeCache, StreamingDataset, readers, write_dataset
from datacache.pytorch.batches import BatchRing, RingCollator, collate
from datacache.pytorch.crossread import populate_write
from datacache.read.open_readers import OpenShards
from datacache.readers import ReaderError, codec
from datacache.readers import zstd as rzstd
from datacache.readers._bufpool import BufferPool


def _image(i: int, side: int = 16) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(i).bytes(side * side * 4), np.uint8).reshape(side, side, 4)


def _samples(n: int, side: int = 16) -> list[dict[str, Any]]:
    return [{"image": _image(i, side), "label": i % 10, "id": i} for i in range(n)]


def _write(path: Any, samples: list[dict[str, Any]], **kw: Any) -> str:
    schema = codec.infer_schema(samples[0])
    with rzstd.ZstdShardWriter(path, schema, **kw) as w:
        for s in samples:
            w.write(s)
    return str(path)


def _check(got: dict[str, Any], i: int, side: int = 16) -> None:
    assert got["id"] == i and got["label"] == i % 10
    assert np.array_equal(got["image"], _image(i, side)), f"sample {i}: wrong pixels"


# ---------------------------------------------------------------- readers
def test_incompressible_blocks_are_stored_raw_and_read_in_place(tmp_path: Any) -> None:
    noisy = _write(tmp_path / "noisy.dcz", _samples(40, side=64), block_bytes=40_000)
    flat = _write(tmp_path / "flat.dcz", [{"image": np.zeros((16, 16, 4), np.uint8), "label": 1, "id": i}
                                          for i in range(40)], block_bytes=4096)
    with rzstd.ZstdShardReader(noisy) as r:
        assert (r._blocks[:, 0] & np.uint64(rzstd.RAW_BLOCK) != 0).all()
        got = list(r.iter_range(0, len(r)))
        mapped = np.frombuffer(r._mmap, dtype=np.uint8)  # the reader's map of the shard file
        # a view into the mapped file itself, not a copy (a copy also has a .base: its buffer)
        assert all(np.shares_memory(s["image"], mapped) for s in got)
        del mapped
        for i, s in enumerate(got):
            _check(s, i, side=64)
    with rzstd.ZstdShardReader(flat) as r:
        assert not (r._blocks[:, 0] & np.uint64(rzstd.RAW_BLOCK)).any()
        assert [s["id"] for s in r] == list(range(40))
    for s in got:  # the reader is closed; its samples still read their (still mapped) bytes
        assert s["image"].shape == (64, 64, 4)
    _check(got[39], 39, side=64)


def test_raw_block_with_mismatched_sizes_is_rejected(tmp_path: Any) -> None:
    from array import array

    body = bytearray(rzstd.MAGIC) + codec.encode_sample({"x": b"abc"}, {"x": "bytes"})
    blocks = array("Q", (4 | rzstd.RAW_BLOCK, len(body) - 4, len(body) - 3, 0))
    index = rzstd._encode_index({"x": "bytes"}, 0, 0, blocks, array("Q", (0, len(body) - 4)))
    path = tmp_path / "bad.dcz"
    path.write_bytes(bytes(body) + index + rzstd._encode_footer(len(body), index, 1))
    with pytest.raises(ReaderError, match="raw block"):
        rzstd.ZstdShardReader(path)


@pytest.mark.parametrize("other", [
    {"a": np.zeros((4, 2), np.float32)},   # same bytes, other shape
    {"a": np.zeros((2, 4), np.int32)},     # same bytes, other dtype
])
def test_uniform_decoding_keeps_each_samples_own_header(tmp_path: Any, other: dict[str, Any]) -> None:
    samples = [{"a": np.arange(8, dtype=np.float32).reshape(2, 4) + i} for i in range(6)]
    samples[4] = {"a": other["a"] + 4}
    path = _write(tmp_path / "s.dcz", samples)
    got = list(readers.open_shard("zstd", path))
    for g, w in zip(got, samples):
        assert g["a"].dtype == w["a"].dtype and g["a"].shape == w["a"].shape
        assert np.array_equal(g["a"], w["a"])


def test_uniform_decoding_equals_sample_by_sample(tmp_path: Any) -> None:
    samples = [{"v": np.float64(i) * np.ones(3), "s": np.array(i, np.int16), "f": i / 3, "n": -i}
               for i in range(50)]
    path = _write(tmp_path / "s.dcz", samples, block_bytes=600)
    with rzstd.ZstdShardReader(path) as r:
        fast = list(r.iter_range(5, 45))
        slow = [r.get(i) for i in range(5, 45)]
    for f, s in zip(fast, slow):
        assert f.keys() == s.keys()
        for k in f:
            assert type(f[k]) is type(s[k]) and np.array_equal(f[k], s[k])
            assert getattr(f[k], "shape", None) == getattr(s[k], "shape", None)


def test_pooled_buffer_is_not_reused_while_a_sample_views_it(tmp_path: Any) -> None:
    samples = [{"x": np.full(1000, i % 7, np.uint8), "id": i} for i in range(200)]  # compressible
    path = _write(tmp_path / "s.dcz", samples, block_bytes=8000)
    with rzstd.ZstdShardReader(path) as r:
        assert not (r._blocks[:, 0] & np.uint64(rzstd.RAW_BLOCK)).any()
        held = next(iter(r.iter_range(0, 1)))
        for _ in range(3):
            for s in r.iter_range(0, len(r)):
                assert np.array_equal(s["x"], np.full(1000, s["id"] % 7, np.uint8))
    assert held["id"] == 0 and np.array_equal(held["x"], np.zeros(1000, np.uint8))


def test_buffer_pool_reuses_only_free_buffers() -> None:
    pool = BufferPool(max_buffers=4)
    a = pool.take(1000)
    a[:] = b"a" * 1000
    b = pool.take(1000)  # a is still referenced: a new buffer
    assert pool.allocated == 2 and bytes(a) == b"a" * 1000
    del a
    c = pool.take(900)
    assert pool.reused == 1 and len(c) == 900
    del b, c


def test_open_shards_reuses_a_reader_until_its_file_changes(tmp_path: Any) -> None:
    fmt = readers.get_format("zstd")
    path = _write(tmp_path / "s.dcz", _samples(5))
    shards = OpenShards(max_open=2, sweep_every=0)
    r1 = shards.checkout(fmt, path, {})
    shards.checkin(fmt, path, r1, {})
    assert shards.checkout(fmt, path, {}) is r1
    shards.checkin(fmt, path, r1, {})
    tmp = _write(tmp_path / "t.dcz", _samples(7))
    os.replace(tmp, path)  # how the cache replaces an entry: a new file
    r2 = shards.checkout(fmt, path, {})
    assert r2 is not r1 and len(r2) == 7
    shards.checkin(fmt, path, r2, {})
    os.unlink(path)
    other = _write(tmp_path / "o.dcz", _samples(3))
    r3 = shards.checkout(fmt, other, {})  # sweeps the reader of the deleted file
    assert r2._closed and shards._idle == {}
    shards.checkin(fmt, other, r3, {})
    shards.close()
    assert r3._closed


def test_open_shards_takes_the_identity_of_a_pinned_file_from_its_descriptor(tmp_path: Any) -> None:
    """A caller holding the file open (a cache entry's pin) passes its descriptor: the reader is
    checked against the file it pins, whatever the path names meanwhile, and a descriptor of
    another file gets another reader."""
    fmt = readers.get_format("zstd")
    path = _write(tmp_path / "s.dcz", _samples(5))
    shards = OpenShards(max_open=2, sweep_every=0)
    pin = os.open(path, os.O_RDONLY)
    try:
        r1 = shards.checkout(fmt, path, {}, fd=pin)
        shards.checkin(fmt, path, r1, {})
        os.replace(_write(tmp_path / "t.dcz", _samples(7)), path)  # the path names another file now
        assert shards.checkout(fmt, path, {}, fd=pin) is r1, "the pinned file is the reader's"
        shards.checkin(fmt, path, r1, {})
        new = os.open(path, os.O_RDONLY)
        try:
            r2 = shards.checkout(fmt, path, {}, fd=new)
            assert r2 is not r1 and len(r2) == 7 and r1._closed
            shards.checkin(fmt, path, r2, {})
        finally:
            os.close(new)
    finally:
        os.close(pin)
    shards.close()


def test_a_reader_handed_out_again_for_tables_makes_its_whole_table_first(tmp_path: Any) -> None:
    """A cached shard's reader kept open and handed out again to a caller that reads tables
    (``checkout(tables=True)``) makes its whole-shard table then, even if it was only read sample by
    sample (a cold epoch's part mix): not while a sample view it handed out may have been written,
    and the table reads as in the file after such a write. Without ``tables`` it makes none."""
    from datacache.readers.columns import Columns

    fmt = readers.get_format("zstd")
    samples = _samples(40)
    path = _write(tmp_path / "s.dcz", samples, block_bytes=1 << 12)
    shards = OpenShards(max_open=4, sweep_every=0)
    r = shards.checkout(fmt, path, {})
    assert ((r._blocks[:, 0] & np.uint64(rzstd.RAW_BLOCK)) != 0).all(), "the fixture's blocks should be raw"
    assert r._whole is None, "a reader handed out for samples makes none"
    view = r.get(3)["image"]
    view[:] = 0  # a sample is writable; its view is still alive at the next checkout
    shards.checkin(fmt, path, r, {})
    assert shards.checkout(fmt, path, {}, tables=True) is r and r._whole is None
    del view
    gc.collect()
    shards.checkin(fmt, path, r, {})
    assert shards.checkout(fmt, path, {}, tables=True) is r and isinstance(r._whole, Columns)
    rows = np.array([0, 3, 17, 39])
    table = r.columns(0, 40, rows)
    assert isinstance(table, Columns)
    for k, i in enumerate(rows.tolist()):
        got = table.sample(k)
        assert np.array_equal(got["image"], samples[i]["image"]) and got["id"] == i, f"row {i}"
    for bad in ([3, 0], [0, 40], [-1, 2], [5, 5, 4]):  # unsorted, or outside [lo, hi): refused, not misread
        with pytest.raises(IndexError):
            r.columns(0, 40, np.array(bad))
    assert r.columns(0, 40, np.array([7, 7])).n == 2 and r.columns(0, 40, np.array([], np.int64)).n == 0
    shards.checkin(fmt, path, r, {})
    shards.close()
    plain = OpenShards(sweep_every=0)
    r2 = plain.checkout(fmt, path, {})
    r2.get(0)
    plain.checkin(fmt, path, r2, {})
    assert plain.checkout(fmt, path, {}) is r2 and r2._whole is None
    plain.close()


def test_a_whole_table_is_made_beside_live_views_that_wrote_nothing_and_used_once_they_are_gone(
        tmp_path: Any) -> None:
    """A cold epoch's kept rows are live views of the mapping: the whole-shard table is parsed
    while they live if none of them wrote (so its page faults happen then, not before the first
    warm batch), and is used only once no view is alive. A view that writes after the parse keeps
    it unused; its rows read as in the file, before and after the view is gone."""
    from datacache.readers.columns import Columns

    fmt = readers.get_format("zstd")
    samples = _samples(40)
    path = _write(tmp_path / "s.dcz", samples, block_bytes=1 << 12)
    shards = OpenShards(max_open=4, sweep_every=0)
    r = shards.checkout(fmt, path, {}, tables=True)
    from datacache.readers import _cowmap
    if _cowmap._pagemap() is None:
        pytest.skip("no readable /proc/self/pagemap: every page handed out counts as written")
    kept = r.get_many([3, 4, 30], copy=True)  # views of the raw blocks, as a part mix stashes them
    shards.checkin(fmt, path, r, {})
    assert shards.checkout(fmt, path, {}, tables=True) is r and isinstance(r._whole, Columns), \
        "made beside views that wrote nothing"
    assert r._whole_table(40) is None, "not used while a view is alive"
    kept[0]["image"][:] = 0  # a write after the parse
    rows = np.array([0, 3, 30, 39])
    for table in (r.columns(0, 40, rows), None):
        if table is None:
            del kept
            gc.collect()
            table = r.columns(0, 40, rows)
        assert isinstance(table, Columns)
        for k, i in enumerate(rows.tolist()):
            assert np.array_equal(table.sample(k)["image"], samples[i]["image"]), f"row {i}"
    assert r._whole_table(40) is r._whole, "used once no view is alive"
    shards.checkin(fmt, path, r, {})
    shards.close()


def test_a_reader_that_fails_to_prepare_its_tables_is_closed_not_left_mapped(tmp_path: Any) -> None:
    fmt = readers.get_format("zstd")
    path = _write(tmp_path / "s.dcz", _samples(8), block_bytes=1 << 12)
    shards = OpenShards(sweep_every=0)
    r = shards.checkout(fmt, path, {})
    shards.checkin(fmt, path, r, {})

    def fail() -> None:
        raise MemoryError("no room for the table")
    r.prepare_tables = fail
    with pytest.raises(MemoryError):
        shards.checkout(fmt, path, {}, tables=True)
    assert r.closed and shards._idle == {}
    assert shards.checkout(fmt, path, {}, tables=True) is not r  # the next caller gets a reader afresh
    shards.close()


# ---------------------------------------------------------------- collation and rings
def test_collate_fields() -> None:
    samples = [{"i": k, "f": k / 2, "b": bool(k % 2), "s": str(k), "a": np.ones((2, 3)) * k,
                "r": np.ones(k + 1)} for k in range(4)]
    out = collate(samples)
    assert list(out) == ["i", "f", "b", "s", "a", "r"]
    assert out["i"].dtype == torch.int64 and out["i"].tolist() == [0, 1, 2, 3]
    assert out["f"].dtype == torch.float64 and out["f"].tolist() == [0, 0.5, 1, 1.5]
    assert out["b"].dtype == torch.bool and out["b"].tolist() == [False, True, False, True]  # as default_collate
    assert out["s"] == ["0", "1", "2", "3"]
    assert out["a"].shape == (4, 2, 3) and float(out["a"][3, 1, 2]) == 3.0
    assert isinstance(out["r"], list) and len(out["r"][3]) == 4


def test_ring_slot_is_reused_only_when_every_tensor_is_gone() -> None:
    ring = RingCollator(shared=False, slots=2)
    first = ring(_samples(8)[:4])
    view = first["image"][1:3]  # a view keeps the whole slot
    del first
    gc.collect()
    later = [ring(_samples(8)[4:]) for _ in range(3)]  # one slot free: then plain memory
    assert ring.ring is not None and ring.ring.fallbacks == 2
    for i, s in enumerate(view):
        assert torch.equal(s, torch.from_numpy(_image(i + 1).copy()))
    del view, later
    gc.collect()
    before = ring.ring.published
    batch = ring(_samples(4))
    assert ring.ring.published == before + 1
    assert torch.equal(batch["image"][2], torch.from_numpy(_image(2).copy()))


def test_failed_batch_gives_its_slot_back() -> None:
    ring = RingCollator(shared=False, slots=2)
    ring(_samples(4))
    bad = _samples(4)
    bad[2]["id"] = 2 ** 70  # does not fit the int64 column
    with pytest.raises(OverflowError):
        ring(bad)
    gc.collect()
    assert ring.ring is not None and ring.ring.in_use() == 0


def test_a_larger_batch_gets_a_larger_ring_and_the_old_ones_batches_stay() -> None:
    ring = RingCollator(shared=False)
    small = ring(_samples(2))
    first = ring.ring
    big = ring(_samples(64))
    assert ring.ring is not None and ring.ring is not first and ring.ring.fallbacks == 0
    assert ring.ring.slot_bytes >= 64 * _image(0).nbytes
    assert big["id"].tolist() == list(range(64)) and small["id"].tolist() == [0, 1]
    assert torch.equal(small["image"][1], torch.from_numpy(_image(1).copy()))


def test_ring_falls_back_once_it_has_grown_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    from datacache.pytorch import batches as _batches

    monkeypatch.setattr(_batches, "_GROWTHS", 0)
    ring = RingCollator(shared=False)
    ring(_samples(2))
    big = ring(_samples(64))
    assert ring.ring is not None and ring.ring.fallbacks == 1
    assert big["id"].tolist() == list(range(64))


def test_no_ring_where_shared_memory_is_short(small_tmpfs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from datacache.pytorch import batches as _batches

    monkeypatch.setattr(_batches, "_SHM_DIR", str(small_tmpfs))  # 32 MB: 16 slots of 2 MB do not fit twice
    ring = RingCollator(shared=True)
    batch = ring(_samples(32, side=128))
    assert ring.ring is None and not os.listdir(small_tmpfs)
    assert isinstance(batch["image"], torch.Tensor) and batch["id"].tolist() == list(range(32))
    assert torch.equal(batch["image"][5], torch.from_numpy(_image(5, 128).copy()))
    small = RingCollator(shared=True, slots=2)  # 2 slots of 256 KB fit: a ring, in that directory
    small(_samples(8, side=64))
    assert small.ring is not None and small.ring.path is not None
    assert os.path.dirname(small.ring.path) == str(small_tmpfs)
    small.close()


def _dead_pid() -> int:
    p = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    p.start()
    p.join()
    return p.pid


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_shared_ring_file_left_by_killed_processes_is_removed() -> None:
    dead = _dead_pid()
    stale = f"/dev/shm/datacache-batch-{dead}-{dead}-0"
    with open(stale, "wb") as f:
        f.write(b"x")
    ring = BatchRing(4096, 2, shared=True)
    assert not os.path.exists(stale)
    assert ring.path is not None and os.path.exists(ring.path)
    ring.close()  # nothing published: removed at once
    assert not os.path.exists(ring.path)


def _ring_files() -> set[str]:
    """This process's batch rings in /dev/shm (a ring is named after its training process, the worker's
    parent): the suite runs in several processes at once, whose tests make rings of their own."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"datacache-batch-{os.getpid()}-")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_through_rings_are_exact_even_when_all_are_kept(tmp_path: Any, cache: NodeCache,
                                                                workers: int) -> None:
    url = f"file://{tmp_path}/ds"
    write_dataset(iter(_samples(300, side=24)), url, shard_bytes=40_000, progress=False)
    before = _ring_files()
    ds = StreamingDataset(url, cache=cache, batch_size=4, seed=3)  # ~38 batches per worker, 16 slots
    loader = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
    for epoch in range(2):
        ds.set_epoch(epoch)
        kept = [b for b in loader]  # more batches than ring slots: later ones fall back, none is overwritten
        ids = [i for b in kept for i in b["id"].tolist()]
        assert sorted(ids) == list(range(300))
        for b in kept:
            assert isinstance(b["image"], torch.Tensor) and b["image"].shape[1:] == (24, 24, 4)
            for i, img, label in zip(b["id"].tolist(), b["image"], b["label"].tolist()):
                assert label == i % 10 and torch.equal(img, torch.from_numpy(_image(i, 24).copy())), f"sample {i}"
        del kept
    del loader
    gc.collect()
    ds.close()
    assert _ring_files() <= before, "a batch ring file was left in /dev/shm"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["hold", "release"])
def test_a_full_dev_shm_gives_the_batch_or_the_error_never_a_hang(tmp_path: Any, mode: str) -> None:
    """Issue 37 point 2: /dev/shm fills up under a training loop with two DataLoader workers (a
    private 48 MB tmpfs). A loop that keeps every batch runs the rings out
    of slots, and the batches after need fresh shared memory: the error arrives, one line naming
    /dev/shm and the cause (it used to be dropped in torch's queue feeder thread, and the loop
    waited for ever). A loop that lets its batches go gets every one, exactly, from the rings (with
    the RAM tier in that /dev/shm too, as by default)."""
    from tests.helpers import shm_full_job

    n = 2000  # 63 batches of 32: more than the 2 x 16 ring slots
    url = f"file://{tmp_path}/ds"
    write_dataset(({"i": i, "x": np.full(1024, i, np.int32)} for i in range(n)), url, shard_bytes=200_000,
                  progress=False)
    got = shm_full_job.run(url, tmp_path, mode)
    ids = got["ids"]
    assert len(set(ids)) == len(ids) and set(ids) <= set(range(n)), "a batch came twice or with wrong samples"
    if mode == "release":
        assert got["error"] is None and sorted(ids) == list(range(n))
    else:
        assert got["error"] is not None and len(ids) < n, got
        assert re.match(r"CacheError: (datacache\.errors\.CacheError: )?/dev/shm has no room for a batch tensor of "
                        r"\d+ bytes \(No space left on device.*--shm-size", got["error"]), got["error"]


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_batches_alive_when_the_interpreter_exits_free_their_slots_quietly(tmp_path: Any) -> None:
    """A batch still referenced when the interpreter exits frees its ring slot then, while module
    globals are already gone: no "Exception ignored" on stderr (as once: ``mmap item value must be
    an int``)."""
    import subprocess
    import sys

    url = f"file://{tmp_path}/ds"
    write_dataset(({"x": np.full(256, i, np.uint8), "id": i} for i in range(200)), url, shard_bytes=20_000,
                  progress=False)
    script = (f"import datacache\n"
              f"cfg = datacache.CacheConfig(ram_dir={str(tmp_path / 'ram')!r}, ssd_dir={str(tmp_path / 'ssd')!r})\n"
              f"ds = datacache.StreamingDataset({url!r}, cache=cfg, seed=1)\n"
              f"kept = [b for b in datacache.DataLoader(ds, batch_size=16, num_workers=1)]\n"
              f"print(sum(len(b['id']) for b in kept))\n")
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100,
                         stdin=subprocess.DEVNULL)
    assert got.returncode == 0 and got.stdout.split() == ["200"], got.stderr
    assert "Exception ignored" not in got.stderr and "Traceback" not in got.stderr, got.stderr


def test_a_reader_opened_for_tables_takes_its_first_run_from_its_whole_table(tmp_path: Any) -> None:
    """A reader opened for a caller that reads tables, where the pool has room to keep it, makes its
    whole-shard table as it is handed out: its first run's rows are taken from it, not parsed on
    their own first (then the whole shard again as it is checked in)."""
    from datacache.readers.columns import Columns

    fmt = readers.get_format("zstd")
    samples = _samples(40)
    path = _write(tmp_path / "s.dcz", samples, block_bytes=1 << 12)
    shards = OpenShards(max_open=4, sweep_every=0)
    r = shards.checkout(fmt, path, {}, tables=True)
    assert isinstance(r._whole, Columns), "made as it is handed out"
    table = r.columns(0, 40, np.array([2, 30]))
    assert r._layouts is None, "no rows parsed on their own"
    for k, i in enumerate((2, 30)):
        got = table.sample(k)
        assert np.array_equal(got["image"], samples[i]["image"]) and got["id"] == i
    shards.checkin(fmt, path, r, {}, tables=True)
    shards.close()


def test_a_reader_checked_in_makes_its_table_only_where_the_pool_keeps_it(tmp_path: Any) -> None:
    """``checkin(tables=True)`` makes the whole-shard table of a reader the pool has room for, so
    a shard read once has it before its first columnar read; in a full pool (a process reading
    more shards than it keeps open) the reader may be closed before its next read, and making
    its table would parse every row for nothing: it is left to that read's checkout."""
    from datacache.readers.columns import Columns

    fmt = readers.get_format("zstd")
    paths = [_write(tmp_path / f"s{k}.dcz", _samples(12), block_bytes=1 << 12) for k in range(3)]
    shards = OpenShards(max_open=2, sweep_every=0)
    got, made = [], []
    for path in paths:
        r = shards.checkout(fmt, path, {}, tables=True)
        r.get_many([0, 5])
        shards.checkin(fmt, path, r, {}, tables=True)
        got.append(r)
        made.append(isinstance(r._whole, Columns))
    assert made == [True, True, False]
    assert got[0].closed and not got[2].closed, "the oldest reader made room for the newest"
    assert shards.checkout(fmt, paths[2], {}, tables=True) is got[2] and isinstance(got[2]._whole, Columns), \
        "made as it is handed out again"
    shards.checkin(fmt, paths[2], got[2], {}, tables=True)
    r = shards.checkout(fmt, paths[1], {}, tables=True)
    assert r is got[1], "checking a reader in again counts its own place as room"
    shards.checkin(fmt, paths[1], r, {}, tables=True)
    shards.close()


def test_the_pool_of_open_readers_is_sized_by_the_descriptor_limit() -> None:
    """A quarter of the soft limit on open descriptors, between 64 and 4,096 (a child process,
    so that this one's limit is left alone)."""
    code = ("import resource, sys\n"
            "from datacache.read.open_readers import OpenShards, default_max_open\n"
            "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
            "out = []\n"
            "for soft in (128, 1024, 4000, 100000):\n"
            "    if hard != resource.RLIM_INFINITY and soft > hard:\n"
            "        out.append(None); continue\n"
            "    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))\n"
            "    out.append(default_max_open())\n"
            "print(out, OpenShards().max_open == default_max_open(), OpenShards(max_open=3).max_open)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr
    sizes, default, explicit = res.stdout.split("] ")[0] + "]", *res.stdout.split("] ")[1].split()
    for soft, want, got in zip((128, 1024, 4000, 100000), (64, 256, 1000, 4096), sizes.strip("[]").split(", ")):
        assert got == "None" or int(got) == want, f"soft limit {soft}: {got} readers, not {want}"
    assert default == "True" and explicit == "3"


def test_tables_of_shards_alike_in_length_follow_each_row_s_own_structure_bytes(tmp_path: Any) -> None:
    """Shards whose rows have one schema and one length share their parsed layout (a memo), but
    only where a row's structure bytes are the same: arrays of shape (2, 512) then (4, 256), or of
    another dtype of one size, give their own shapes and dtypes, never the layout parsed first."""
    from datacache.readers.columns import Columns

    rng = np.random.default_rng(5)
    kinds = [((2, 512), np.uint8), ((4, 256), np.uint8), ((2, 512), np.int8), ((2, 512), np.uint8)]
    for k, (shape, dtype) in enumerate(kinds):  # incompressible: raw blocks, which make whole tables
        arrays = [rng.integers(0, 256, shape).astype(np.uint8).view(dtype) for _ in range(6)]
        path = _write(tmp_path / f"s{k}.dcz", [{"a": a, "id": i} for i, a in enumerate(arrays)], block_bytes=1 << 16)
        with rzstd.ZstdShardReader(path) as r:
            r.prepare_tables()
            table = r.columns(0, 6)
            assert isinstance(table, Columns) and isinstance(r._whole, Columns)
            col = table.fields["a"]
            assert np.dtype(col.dtype) == np.dtype(dtype) and (col.shape == shape).all(), (k, shape, dtype)
            for i, a in enumerate(arrays):
                got = table.sample(i)
                assert got["id"] == i and got["a"].dtype == a.dtype and np.array_equal(got["a"], a)


def test_a_shared_ring_is_writable_from_its_start_without_a_fault_per_page() -> None:
    """A worker's ring is mapped writable, every page, when it is made: the first batch written into
    each slot (a warm epoch fills more slots than the cold one did) takes no page fault per page."""
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    supported = populate_write is not None and populate_write(probe, mmap.PAGESIZE)
    probe.close()
    if not supported:
        pytest.skip("no MADV_POPULATE_WRITE here (Linux 5.14 and later only): rings fault as written")
    ring = BatchRing(1 << 20, slots=8, shared=True)
    try:
        pages = ring.slots * ring.slot_bytes // mmap.PAGESIZE
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for slot in range(ring.slots):
            ring.buffer(slot)[::mmap.PAGESIZE] = 1  # one byte per page: each page's first write
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < pages // 4, f"{faults} faults writing {pages} pages"
    finally:
        ring.close()
