"""A part-mixed consumer reads each unit once (``datacache.read.stash``): every run's rows are read
exactly once, by the first run that reaches their unit, never later than their own run; the first
chunk's runs read only their own rows; the stash gives each kept sample back once, as a copy; a
missing shard is skipped by its leaders and followers alike."""
from __future__ import annotations

import os
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch.utils.data

import datacache
from datacache import CacheConfig, NodeCache, StreamingDataset, write_dataset
from datacache.plan.ragged import Ragged
from datacache.read.open_readers import open_shards
from datacache.read.stash import Stash, read_plan


def _random_runs(seed: int, runs: int = 300, shards: int = 7, rows: int = 500) -> tuple[list[int], list[np.ndarray]]:
    """Runs as a part mix has them: a shard and a few distinct rows each, every row once."""
    rng = np.random.default_rng(seed)
    pool = [(s, r) for s in range(shards) for r in rng.permutation(rows)[: rows // 2]]
    order = rng.permutation(len(pool))
    cuts = np.sort(rng.choice(np.arange(1, len(pool)), runs - 1, replace=False))
    out_s, out_r = [], []
    for part in np.split(order, cuts):  # a run: one shard's rows of a stretch of the order
        s = pool[int(part[0])][0]
        out_s.append(s)
        out_r.append(np.array(sorted({pool[int(i)][1] for i in part if pool[int(i)][0] == s}), dtype=np.int64))
    return out_s, out_r


@pytest.mark.parametrize("seed, unit, alone", [(0, 16, 0), (1, 16, 5), (2, 1, 0), (3, 240, 3), (4, 0, 0)])
def test_every_row_is_read_once_by_the_first_run_that_reaches_its_unit(seed: int, unit: int, alone: int) -> None:
    shards, rows = _random_runs(seed)
    reads = read_plan(shards, rows, unit, alone=alone)
    assert len(reads) == len(rows)
    read_by: dict[tuple[int, int], int] = {}
    for i, (s, got) in enumerate(zip(shards, reads)):
        assert list(got) == sorted(set(got.tolist())), "a run's reads are sorted and distinct"
        for r in got.tolist():
            assert (s, r) not in read_by, f"row {r} of shard {s} read twice"
            read_by[(s, r)] = i
    wanted = {(s, r): i for i, (s, rs) in enumerate(zip(shards, rows)) for r in rs.tolist()}
    assert read_by.keys() == wanted.keys(), "every row is read, and only the runs' rows"
    for key, i in wanted.items():
        assert read_by[key] <= i, "a row is read no later than its own run"
        if i < alone:
            assert read_by[key] == i, "the first chunk's runs read their own rows"
    if unit > 0:
        first: dict[tuple[int, int], int] = {}
        for i, (s, rs) in enumerate(zip(shards, rows)):
            if i >= alone:
                for r in rs.tolist():
                    first.setdefault((s, r // unit), i)
        for (s, r), i in read_by.items():
            if wanted[(s, r)] >= alone:
                assert i == first[(s, r // unit)], "read by the first run that reaches its unit"
    else:
        assert all(np.array_equal(a, b) for a, b in zip(reads, rows)), "no unit: each run reads its own"


def test_a_row_in_several_runs_is_read_once_a_run() -> None:
    """A padded plan repeats a few samples, at times in one consumer's runs (and a run may hold a
    repeat itself): each run reads a row once, and each row is read no later than its first run."""
    shards, rows = _random_runs(6, runs=60, shards=3, rows=100)
    rows[40] = np.sort(np.append(rows[40], rows[3][:1]))  # run 3's first row again, 37 runs later
    rows[41] = np.sort(np.append(rows[41], rows[41][:1]))  # and a repeat inside one run
    shards[40], shards[41] = shards[3], shards[41]
    for unit, alone in ((16, 0), (16, 5), (1, 0), (240, 2)):
        reads = read_plan(shards, rows, unit, alone=alone)
        first: dict[tuple[int, int], int] = {}
        for i, (s, rs) in enumerate(zip(shards, rows)):
            for r in rs.tolist():
                first.setdefault((s, r), i)
        read_by: dict[tuple[int, int], int] = {}
        for i, (s, got) in enumerate(zip(shards, reads)):
            assert list(got) == sorted(set(got.tolist())), "a run's reads are sorted and distinct"
            for r in got.tolist():
                read_by.setdefault((s, r), i)
        assert read_by.keys() == first.keys() and all(read_by[k] <= first[k] for k in first)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [None, 2])
def test_a_part_mix_whose_padding_repeats_a_sample_in_one_consumer(tmp_path: Path, cache: NodeCache,
                                                                   workers: int | None) -> None:
    """400 samples on 3 ranks: each rank reads 134, and with this seed rank 1 reads one of its own
    samples twice (the padding). In one process per rank the repeat lies in one consumer's runs,
    whose leader once read the row twice and failed (KeyError); through a DataLoader of 2 workers
    a rank, as a user reads it, every sample comes once too, plus the 2 padded."""
    url = f"file://{tmp_path}/ds"
    write_dataset(({"i": i, "x": np.full(4, i, dtype=np.int32)} for i in range(400)), url,
                  shard_bytes=2000, progress=False)
    seen: Counter[int] = Counter()
    repeats = 0
    for rank in range(3):
        ds = StreamingDataset(url, cache=cache, seed=7, dp_rank=rank, dp_size=3)
        src = ds if workers is None else torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        ids = [int(s["i"]) for s in src]
        assert len(ids) == 134
        if rank == 0:
            assert ds.stats()["partial_bytes"] > 0, "a part-mixed cold epoch"
        repeats += len(ids) - len(set(ids))
        seen.update(ids)
        ds.close()
    assert repeats >= 1, "some rank reads a sample of its own twice (else this test checks nothing new)"
    assert set(seen) == set(range(400)) and sum(seen.values()) == 402, "every sample, plus the 2 padded"


def test_a_unit_read_ahead_saves_loads() -> None:
    """With 240-sample units (the 200,000 x 4 KB case), most runs read nothing themselves."""
    shards, rows = _random_runs(5, runs=2000, shards=4, rows=2000)
    reads = read_plan(shards, rows, 240)
    assert sum(1 for r in reads if len(r)) < len(reads) / 4


def test_the_stash_gives_each_sample_back_once() -> None:
    stash = Stash()
    stash.put_many(3, {10: {"x": np.arange(8, dtype=np.uint8), "i": 10}, 11: {"x": np.zeros(4), "i": 11}})
    assert stash.nbytes == 8 + 32 and len(stash) == 2
    got = stash.take_many(3, [10, 12])
    assert list(got) == [10] and got[10]["i"] == 10 and got[10]["x"].tolist() == list(range(8))
    assert stash.nbytes == 32 and len(stash) == 1
    assert stash.take_many(3, [10]) == {}, "once"
    assert stash.take_many(4, [11]) == {}, "by shard and row"
    stash.clear()
    assert stash.nbytes == 0 and len(stash) == 0


def test_a_leaders_read_for_the_stash_owns_its_memory(tmp_path: Path) -> None:
    """read_rows(copy=True) (a leader's read, datacache.read.stash) of compressed blocks: the
    samples' arrays are views of one array that owns its memory and holds the picked rows alone,
    so a stashed sample keeps no block buffer (1 MB by default) alive, and shares no memory with
    the reader's buffers."""
    url = f"file://{tmp_path}/ds"
    write_dataset(({"i": i, "x": np.full(64, i, dtype=np.int32)} for i in range(400)), url,
                  shard_bytes=100_000, progress=False, writer_options={"block_bytes": 4096})
    ds = StreamingDataset(url, cache=NodeCache(CacheConfig(ram_dir=str(tmp_path / "ram"), ram_bytes="4MB")))
    handle = ds.source.fetch(0)
    try:
        for picked in ([1, 2, 3, 7], [0, 5, 9, 30, 31]):  # within blocks, and across them
            kept = ds.source.read_rows(0, handle, picked, copy=True)
            views = ds.source.read_rows(0, handle, [r + 1 for r in picked])  # the reader's buffers again
            for r, sample in kept.items():
                assert sample["i"] == r and sample["x"].tolist() == [r] * 64
                assert not any(np.shares_memory(sample["x"], v["x"]) for v in views.values())
                root = sample["x"]
                while isinstance(root.base, np.ndarray):
                    root = root.base
                assert root.flags.owndata and root.nbytes < len(picked) * 400, "its rows alone, in memory of their own"
    finally:
        handle.release()
        ds.close()


def test_a_leaders_read_of_raw_blocks_keeps_views_of_the_file_mapping(tmp_path: Path) -> None:
    """read_rows(copy=True) of raw (incompressible) blocks copies nothing: each stashed array is a
    view of the shard file's mapping, which costs no memory of the process's own. Such a view
    outlives the read, the handle, the reader and the file itself (deleted, as an eviction does):
    the values stay the written ones."""
    url = f"file://{tmp_path}/ds"
    values = {i: np.frombuffer(np.random.default_rng(i).bytes(4096), np.uint8) for i in range(120)}
    write_dataset(({"i": i, "x": values[i]} for i in range(120)), url, shard_bytes=200_000, progress=False)
    ds = StreamingDataset(url, cache=NodeCache(CacheConfig(ram_dir=str(tmp_path / "ram"), ram_bytes="4MB")))
    handle = ds.source.fetch(0)
    path = handle.path
    try:
        kept = ds.source.read_rows(0, handle, [1, 2, 3, 17, 40], copy=True)
    finally:
        handle.release()
    ds.close()
    os.unlink(path)
    from datacache.pytorch.gather import _file_backed
    for r, sample in kept.items():
        assert _file_backed(sample["x"]), "a view of the mapped shard, not a copy"
        assert sample["i"] == r and np.array_equal(sample["x"], values[r])


@pytest.mark.timeout(180)
def test_a_part_mix_skips_a_missing_shard_and_delivers_every_other_sample_once(tmp_path: Path,
                                                                               cache: NodeCache) -> None:
    """on_error="skip" in a part-mixed cold epoch: the runs that lead a missing shard's units fail
    and skip it; its followers, whose rows the stash never got, skip it too (the consumer's own
    thread), with one warning; every sample of the other shards comes once."""
    n = 1200
    url = f"file://{tmp_path}/ds"
    m = write_dataset(({"i": i, "x": np.full(64, i, dtype=np.int32)} for i in range(n)), url,
                      shard_bytes=8000, progress=False, writer_options={"block_bytes": 2048})
    victim = 3
    os.unlink(os.path.join(tmp_path, "ds", m.shards[victim].name))
    ds = StreamingDataset(url, cache=cache, seed=1, on_error="skip")
    held = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ids = []
        for k, s in enumerate(ds):
            ids.append(int(s["i"]))
            if k % 100 == 99:
                held.append(ds.stats()["stash_bytes"])
        ids.sort()
    assert max(held) > 0, "leaders read ahead for later runs; stats() shows the bytes held"
    lo, hi = m.offsets[victim], m.offsets[victim + 1]
    assert ids == [i for i in range(n) if not lo <= i < hi], "every other sample, once"
    assert len([w for w in caught if "skipping shard" in str(w.message)]) == 1
    assert ds.stats()["partial_bytes"] > 0 and ds.stats()["skipped_shards"] == 1, "a part mix, one shard skipped"
    ds.close()


def test_ragged_holds_the_arrays_it_was_given() -> None:
    arrays = [np.array([3, 1]), np.array([], dtype=np.int64), np.array([7])]
    r = Ragged.of(arrays)
    assert len(r) == 3 and r.sizes().tolist() == [2, 0, 1] and Ragged.of(r) is r
    assert [a.tolist() for a in r] == [[3, 1], [], [7]] and r[-1].tolist() == [7] and r == Ragged.of(arrays)
    with pytest.raises(IndexError):
        r[3]
    with pytest.raises(ValueError, match="cuts must run from 0 to 3"):
        Ragged(np.arange(3), np.array([0, 2]))


@pytest.mark.timeout(120)
def test_an_epoch_read_to_its_end_leaves_no_view_of_a_shard_alive(tmp_path: Path, cache: NodeCache) -> None:
    """The batching stage reads the consumer through a generator that the last batch leaves
    suspended after its last sample. Closed when the epoch ends, its open runs let their samples go:
    views of the shard files' mappings (raw blocks, stashed or read), which would keep each kept
    reader from making its whole-shard table (``CowMap.clean``) until a garbage collection."""
    url = f"file://{tmp_path}/ds"
    n = 38 * 16  # whole batches: the last batch asks the generator for no sample beyond the last
    write_dataset(({"i": i, "x": np.frombuffer(np.random.default_rng(i).bytes(4096), np.uint8)} for i in range(n)),
                  url, shard_bytes=200_000, progress=False)
    ds = StreamingDataset(url, cache=cache, batch_size=16, seed=3)
    loader = datacache.DataLoader(ds, batch_size=16, num_workers=0)
    seen = [int(i) for batch in loader for i in batch["i"]]
    assert sorted(seen) == list(range(n))
    readers = [r for r, _ in open_shards()._idle.values()  # this test's: the process's may hold others'
               if getattr(r, "_cow", None) is not None and str(r.path).startswith(str(tmp_path))]
    assert readers, "the epoch kept its shards' readers open"
    for r in readers:
        r.prepare_tables()
    assert all(r._whole not in (None, False) for r in readers), "a view handed out in the epoch is still alive"
    ds.close()


def test_a_shard_read_once_for_a_dataset_read_as_tables_has_its_table_when_it_is_checked_in(tmp_path: Path,
                                                                                            cache: NodeCache) -> None:
    """A cold part mix reads most shards through their partial copies, and each from the cache at
    most once or twice (the copy completes at its last unit): the kept reader of the cached file
    makes its whole-shard table as that read checks it in, so the first warm epoch does not make
    every table (and fault in every page) before its first batch."""
    from datacache.readers.columns import Columns

    url = f"file://{tmp_path}/ds"
    write_dataset(({"i": i, "x": np.frombuffer(np.random.default_rng(i).bytes(4096), np.uint8)} for i in range(120)),
                  url, shard_bytes=200_000, progress=False)
    ds = StreamingDataset(url, cache=cache, batch_size=8)
    ds.source.tables = True  # as a columnar dataset's consumer sets it
    handle = ds.source.fetch(0)
    try:
        got = ds.source.read_rows(0, handle, [1, 2, 40])
        assert [int(s["i"]) for s in got.values()] == [1, 2, 40]
        path = handle.path
    finally:
        handle.release()
    del got
    kept = [r for r, _ in open_shards()._idle.values() if str(r.path) == str(path)]
    assert len(kept) == 1 and isinstance(kept[0]._whole, Columns), "the table is made as the read checks it in"
    ds.close()
