"""The node mix (datacache.plan.node_shuffle): a warm epoch is one uniform permutation of the node's share.

Statistical checks with fixed seeds, not timed: on class-sorted data (class = id x 100 // n) the
batches of a node-mixed epoch hold at least 0.9 of the distinct classes a uniform random
permutation's batches hold (the bench's case and a dataset far larger than any window), while the
sliding window's hold about 0.4; exactly once through real DataLoader workers; the rules for when
an epoch mixes. Resuming a mixed epoch is checked by tests/test_resume.py (epochs 1 and 2 of its
dataset are node-mixed: it fits in the test cache)."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from datacache import CacheConfig, NodeCache, StreamingDataset, write_dataset
from datacache.plan.epoch import PlanSpec, build_plan
from datacache.plan.node_shuffle import chunk_bounds, chunk_runs, mix_positions
from datacache.plan.part_shuffle import part_chunk
from datacache.read.consumer import decode_ahead
from datacache.read.headstart import RUNS_PER_WORKER, first_chunks
from tests.helpers import faults
from tests.helpers.plans import SETTINGS
from tools.bench_quality import batch_quality


def quality(batches: list[np.ndarray], n: int) -> float:
    """Mean distinct classes per full batch over a uniform random permutation's."""
    return batch_quality([x for x in batches if len(x) == len(batches[0])], n)


def plan_batches(n: int, per_shard: int, sample_bytes: int, *, dp: int = 1, workers: int = 2, bs: int = 32,
                 mix_bytes: int = 1 << 62, epoch: int = 1) -> list[np.ndarray]:
    counts = np.full(-(-n // per_shard), per_shard)
    counts[-1] = n - per_shard * (len(counts) - 1)
    base = PlanSpec(seed=7, epoch=epoch, dp_size=dp, num_workers=workers, batch_size=bs, mix_bytes=mix_bytes,
                    shard_bytes=counts * sample_bytes)
    out, seen = [], []
    for r in range(dp):
        for w in range(workers):
            s = build_plan(counts, replace(base, dp_rank=r, worker_id=w)).samples
            seen.append(s)
            out += [s[i:i + bs] for i in range(0, len(s), bs)]
    assert sorted(np.concatenate(seen).tolist()) == list(range(n))  # exactly once (n divides evenly here)
    return out


@pytest.mark.parametrize("n, per_shard, sample_bytes, dp", [
    (8000, 256, 64 << 10, 1),  # the bench's dataset: 8,000 x 64 KB in 16 MB shards, 2 workers
    (8000, 256, 64 << 10, 4),  # 4 ranks of one node
    (200_000, 4096, 4 << 10, 1),  # far larger than any window: 200,000 x 4 KB, 100 classes of 2,000
])
def test_class_sorted_batches_reach_random_quality(n: int, per_shard: int, sample_bytes: int, dp: int) -> None:
    mixed = quality(plan_batches(n, per_shard, sample_bytes, dp=dp), n)
    window = quality(plan_batches(n, per_shard, sample_bytes, dp=dp, mix_bytes=0), n)
    assert mixed >= 0.9, f"node-mixed batches hold {mixed:.2f} of random's classes"
    assert window < 0.6, f"the sliding window's batches hold {window:.2f}: the data is not class-sorted"


def test_when_an_epoch_mixes() -> None:
    counts = np.full(20, 50)
    spec = PlanSpec(seed=1, epoch=1, dp_size=2, num_workers=2, shard_bytes=counts * 100)
    window = build_plan(counts, spec)
    assert window.rows is None
    assert build_plan(counts, replace(spec, mix_bytes=100_000)).rows is not None  # the share: 20 x 5,000 B
    for no in (dict(mix_bytes=99_999), dict(mix_bytes=100_000, epoch=0), dict(mix_bytes=100_000, shuffle=False),
               dict(mix_bytes=100_000, mix_from=2)):
        other = build_plan(counts, replace(spec, **no))
        assert other.rows is None, no
        if no.get("epoch", 1) == 1 and no.get("shuffle", True):
            assert np.array_equal(other.samples, window.samples), no
    # several nodes with placement="global": every node would need every shard
    assert build_plan(counts, replace(spec, dp_size=4, num_nodes=2, placement="global", mix_bytes=1 << 40)).rows is None
    assert build_plan(counts, replace(spec, dp_size=4, num_nodes=2, mix_bytes=1 << 40)).rows is not None


@pytest.mark.parametrize("unit_rows", [0, 1, 15, 240, 1000])
def test_a_cold_epoch_is_a_part_mix_whatever_its_blocks_hold(unit_rows: int) -> None:
    """``datacache.plan.epoch.part_shuffle.part_mixes``: blocks of many small samples (4 KB samples in 1 MB blocks: 240;
    1 KB: about 1,000) are read part by part too, since a consumer reads each block once for all
    of its runs (``datacache.read.stash``); each part is whole blocks."""
    counts = np.full(30, 1000)
    spec = PlanSpec(seed=4, epoch=0, num_workers=2, batch_size=32, mix_bytes=1 << 40, mix_from=1,
                    part_bytes=1 << 20, shard_bytes=counts * 4096, unit_rows=unit_rows)
    plan = build_plan(counts, spec)
    assert plan.parts and plan.rows is not None
    if unit_rows:
        assert plan.unit_rows == unit_rows
    assert not build_plan(counts, replace(spec, part_bytes=0)).parts  # no ranged reads: the window


@pytest.mark.parametrize("bs, dp, workers", [(32, 1, 2), (8, 2, 3), (100, 1, 4)])
def test_a_head_plan_has_the_first_chunks_of_the_whole_plan(bs: int, dp: int, workers: int) -> None:
    """``build_plan(head=...)``, what a worker plans of the others' first chunks (its part mix's
    lead): the same runs and rows as the whole plan's first chunk, for every consumer."""
    counts = np.full(30, 200)
    base = PlanSpec(seed=4, epoch=0, dp_size=dp, num_workers=workers, batch_size=bs, mix_bytes=1 << 40,
                    mix_from=1, part_bytes=20 * 1000, unit_rows=5, shard_bytes=counts * 1000)
    head = part_chunk(bs, 1 << 62)
    for r in range(dp):
        for w in range(workers):
            spec = replace(base, dp_rank=r, worker_id=w)
            whole, prefix = build_plan(counts, spec), build_plan(counts, spec, shards_only=True, head=head)
            assert whole.parts and prefix.parts and len(prefix) == min(head, len(whole))
            firsts = [[(shard, rows) for _, shard, _, rows in first_chunks(p, 0, 1)] for p in (whole, prefix)]
            assert firsts[0] == firsts[1] and firsts[0], (r, w)
            # the training process's head start plans its workers' first RUNS_PER_WORKER chunks so
            two = build_plan(counts, spec, shards_only=True, head=RUNS_PER_WORKER * head)
            firsts = [[(c, shard, rows) for c, shard, _, rows in first_chunks(p, 0, RUNS_PER_WORKER)]
                      for p in (whole, two)]
            assert firsts[0] == firsts[1], (r, w)


@pytest.mark.parametrize("length", [1, 2, 3, 5, 64, 1000, 4097])
def test_mix_positions_is_a_permutation(length: int) -> None:
    a = mix_positions(np.arange(length), length, seed=0, epoch=1, node=0)
    assert sorted(a.tolist()) == list(range(length))
    assert np.array_equal(mix_positions(np.arange(3, length), length, seed=0, epoch=1, node=0), a[3:])
    if length > 64:
        assert not np.array_equal(a, mix_positions(np.arange(length), length, seed=0, epoch=2, node=0))
        assert not np.array_equal(a, mix_positions(np.arange(length), length, seed=0, epoch=1, node=1))


@SETTINGS
@given(st.lists(st.integers(1, 30), min_size=1, max_size=12), st.integers(0, 2**31 - 1), st.integers(1, 50))
def test_chunks_group_rows_by_shard(counts: list[int], seed: int, chunk: int) -> None:
    """Each run reads sorted rows of one shard within its chunk; a chunk's positions come only from its runs."""
    offsets = np.concatenate([[0], np.cumsum(counts)])
    n = int(offsets[-1])
    piece = np.random.default_rng(seed).permutation(n)
    c = chunk_runs(piece, offsets, chunk)
    bounds = chunk_bounds(n, chunk)
    assert bounds[0] == 0 and np.all(np.diff(bounds) <= chunk) and np.all(np.diff(bounds) >= 1)
    assert c["steps"][-1] == n and np.all(np.diff(c["steps"]) >= 0)
    for r, ((shard, lo, hi), rows) in enumerate(zip(c["runs"], c["rows"])):
        mine = piece[c["run_of"] == r]
        assert np.array_equal(np.sort(mine - offsets[shard]), rows) and rows[0] == lo and rows[-1] == hi - 1
        positions = np.flatnonzero(c["run_of"] == r)
        assert len(set(np.searchsorted(bounds, positions, side="right").tolist())) == 1  # one chunk's
        # each position's row_in_run points at its own row among the run's, each row once
        assert np.array_equal(rows[c["row_in_run"][positions]], piece[positions] - offsets[shard])
        assert sorted(c["row_in_run"][positions].tolist()) == list(range(len(rows)))
    per_chunk = Counter(int(s) for s in c["starts"])
    assert max(per_chunk.values()) == c["window"]


@pytest.fixture(scope="module")
def sorted_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"file://{tmp_path_factory.mktemp('mix')}/ds"
    # blocks of a few samples: many units a shard, each part one of them (datacache.plan.part_shuffle)
    m = write_dataset(({"i": i, "x": np.full(64, i, dtype=np.int32)} for i in range(N)), url,
                      shard_bytes=8000, progress=False, writer_options={"block_bytes": 2048})
    assert len(m.shards) >= 20 and 0 < m.unit_rows < 32, m.unit_rows
    return url


N = 2400


@pytest.mark.timeout(180)
@pytest.mark.parametrize("node_shuffle", ["auto", "window", "never"])
def test_warm_epoch_is_node_mixed_through_workers(sorted_url: str, cache: NodeCache, node_shuffle: str) -> None:
    """Epoch 0 (cold) reads as a part mix with "auto", the default (parts of many shards at once,
    each block fetched once, every shard cached whole by the end), through the sliding window with
    "window" and "never"; epoch 1, its share cached, as one node mix but with "never": random-like batches
    through 2 DataLoader workers, every sample once in each epoch."""
    from datacache import DataLoader

    ds = StreamingDataset(sorted_url, cache=cache, seed=5, node_shuffle=node_shuffle)
    loader = DataLoader(ds, batch_size=32, num_workers=2)
    q, stats = [], []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        batches = [b["i"].numpy() for b in loader]
        ids = np.concatenate(batches)
        assert sorted(ids.tolist()) == list(range(N)), f"epoch {epoch}: not every sample once"
        q.append(quality(batches, N))
        stats.append(cache.stats())
    total = ds.manifest.total_bytes
    ds.close()
    assert stats[0]["remote_bytes"] == total and stats[1]["remote_bytes"] == total  # every shard once
    if node_shuffle == "auto":
        assert q[0] >= 0.8, q
        assert total <= stats[0]["partial_bytes"] <= 1.05 * total  # ranged reads: each block once
    else:
        assert q[0] < 0.6, q
        assert stats[0]["partial_bytes"] == 0
    assert (q[1] < 0.6) if node_shuffle == "never" else (q[1] >= 0.9), q


def test_node_shuffle_is_checked(sorted_url: str, cache: NodeCache) -> None:
    with pytest.raises(ValueError, match="node_shuffle='sometimes': expected one of auto, always, never"):
        StreamingDataset(sorted_url, cache=cache, node_shuffle="sometimes")


def test_always_mixes_the_first_epoch(sorted_url: str, cache: NodeCache) -> None:
    ds = StreamingDataset(sorted_url, cache=cache, seed=5, node_shuffle="always", batch_size=32)
    batches = [b["i"].numpy() for b in torch.utils.data.DataLoader(ds, batch_size=None)]
    ds.close()
    assert sorted(np.concatenate(batches).tolist()) == list(range(N))
    assert quality(batches, N) >= 0.9


def _ids(it, k: int | None = None) -> list[int]:
    out = []
    for sample in it:
        out.append(int(sample["i"]))
        if k is not None and len(out) == k:
            break
    return out


@pytest.mark.timeout(180)
def test_a_mixed_epoch_resumes_where_the_cache_decides_otherwise(sorted_url: str, cache: NodeCache) -> None:
    """The state records the epoch's node-mix decision: resumed on a node whose cache would not mix
    (here node_shuffle="never"), the rest of the epoch is the mixed order's rest, and an elastic
    resume there (2 ranks) reads every sample not yet read exactly once."""
    def make(shuffle: str, **kw):
        ds = StreamingDataset(sorted_url, cache=cache, seed=5, node_shuffle=shuffle, **kw)
        ds.set_epoch(1)
        return ds

    ref_ds = make("always")
    ref = _ids(ref_ds)
    ref_ds.close()
    assert quality([np.array(ref[i:i + 32]) for i in range(0, N, 32)], N) >= 0.9
    for k in (1, 700, N - 1):
        a = make("always")
        it = iter(a)
        head = _ids(it, k)
        state = a.state_dict()
        a.close()
        assert state["mix"][0] > 0
        b = make("never")
        b.load_state_dict(state)
        assert head + _ids(b) == ref, k
        b.close()
        rest = []
        for rank in (0, 1):
            c = make("never", dp_rank=rank, dp_size=2)
            c.load_state_dict(state)
            rest += _ids(c)
            c.close()
        assert sorted(head + rest) == list(range(N)) or (
            len(set(head + rest)) == N and len(rest) - (N - k) <= 1), k  # plus at most one padding repeat
    older = make("always").state_dict()
    older.pop("mix")  # a state saved before the node mix existed: its epoch was read through the window
    d = make("always")
    d.load_state_dict(older)
    window = make("never")
    assert _ids(d) == _ids(window)
    d.close()
    window.close()


def test_the_mixed_share_is_what_the_consumers_read() -> None:
    """``plan.mixed_share`` (what the node schedule and the head start use instead of every
    consumer's plan): the shards the node's mixed consumers read, None for a windowed epoch."""
    from datacache.plan.epoch import mixed_share

    counts = np.array([30, 0, 25, 40, 10, 35, 20, 15])
    spec = PlanSpec(seed=2, epoch=1, dp_size=4, num_nodes=2, num_workers=2, mix_bytes=1 << 40)
    for node_rank in (0, 2):
        read = {run[0] for r in (node_rank, node_rank + 1) for w in range(2)
                for run in build_plan(counts, replace(spec, dp_rank=r, worker_id=w)).runs}
        assert set(mixed_share(counts, replace(spec, dp_rank=node_rank)).tolist()) == read
    assert mixed_share(counts, replace(spec, mix_bytes=0)) is None
    assert mixed_share(counts, replace(spec, epoch=0)) is None


@pytest.mark.timeout(180)
def test_epoch_zero_mixes_when_the_share_is_cached_already(sorted_url: str, cache: NodeCache) -> None:
    """The default ("auto"; "window" likewise, but with the window) in epoch 0: a part mix on an
    empty cache (read part by part, ``datacache.plan.part_shuffle``); a node mix once the share is
    cached (here by another seed's epoch, as ``datacache warm`` would), decided once: the same
    dataset and seed read again keep the decision their first epoch 0 took."""
    def epoch0(seed: int) -> list[int]:
        ds = StreamingDataset(sorted_url, cache=cache, seed=seed)
        ds.set_epoch(0)
        ids = _ids(ds)
        ds.close()
        return ids

    def q(ids: list[int]) -> float:
        return quality([np.array(ids[i:i + 32]) for i in range(0, N, 32)], N)

    cold = epoch0(1)  # an empty cache: a part mix, and it fills the cache
    assert q(cold) >= 0.8 and sorted(cold) == list(range(N)) and cache.stats()["partial_bytes"] > 0
    parts = cache.stats()["partial_bytes"]
    warm = epoch0(2)  # another seed's epoch 0, every shard cached: mixed
    assert q(warm) >= 0.9 and sorted(warm) == list(range(N)) and cache.stats()["partial_bytes"] == parts
    assert epoch0(1) == cold  # seed 1's epoch 0 was decided (a part mix): read again, the same order


def test_the_decode_stage_reads_the_next_chunk_ahead() -> None:
    """``datacache.read.consumer.decode_ahead``: a node-mixed plan's step yields a chunk once every run of it is
    open, so the decode stage may hold the largest chunk's positions ahead (counted in each run's
    rows), not two runs; a plan of whole-shard runs and a part mix (whose decode stage would let
    its fetch stage start more reads at once) keep two."""
    counts = np.full(30, 1000)
    spec = PlanSpec(seed=4, epoch=1, num_workers=2, batch_size=32, mix_bytes=1 << 40, shard_bytes=counts * 4096)
    plan = build_plan(counts, spec)
    assert plan.rows is not None
    size_of, ahead = decode_ahead(plan)
    chunks = np.diff(plan.steps)
    assert ahead == chunks.max() > 1000  # thousands of positions: all of a chunk's runs
    assert [size_of(r) for r in range(len(plan.runs))] == [len(rows) for rows in plan.rows]
    assert sum(size_of(r) for r in range(len(plan.runs))) == len(plan)
    size_of, ahead = decode_ahead(build_plan(counts, replace(spec, mix_bytes=0)))
    assert ahead == 2 and size_of(0) == 1
    part = build_plan(counts, replace(spec, epoch=0, mix_from=1, part_bytes=1 << 20, unit_rows=240))
    assert part.parts and part.rows is not None
    size_of, ahead = decode_ahead(part)
    assert ahead == 2 and size_of(0) == 1


@pytest.mark.timeout(120)
def test_a_node_mixed_consumer_decodes_its_next_chunk_while_it_yields_one(sorted_url: str, cache: NodeCache) -> None:
    """While the consumer yields its first chunks, the decode stage reads every run of the next
    one (with two runs ahead, the consumer waited for them one by one at each chunk's start)."""
    ds = StreamingDataset(sorted_url, cache=cache, seed=5, node_shuffle="always")
    it = iter(ds)
    next(it)  # the first chunk is open
    consumer = ds._consumer
    plan = consumer.plan
    steps = np.flatnonzero(np.diff(plan.steps))  # the steps that yield (each chunk's last run)
    first_yield = int(steps[0])
    next_chunk = int(steps[1]) - first_yield  # the runs of the second chunk
    assert next_chunk > 2
    faults.wait_for(lambda: consumer.decoder.depth >= next_chunk, 60,
                    f"the decode stage to start the {next_chunk} runs of the next chunk (two before)")
    rest = list(it)
    ds.close()
    assert len(rest) == N - 1


@pytest.mark.timeout(120)
def test_a_chunk_of_rows_read_in_place_is_larger(tmp_path: Any) -> None:
    """A node mix's chunk bounds the memory its decoded rows hold: where the blocks are raw (read in
    place from the cached file), the warm epoch's chunks are larger (16 x), in fewer runs than
    over compressed blocks of half the bytes. Every sample once."""
    n, chunks, inflation = 6000, {}, {}
    for kind in ("raw", "compressed"):
        url = f"file://{tmp_path}/{kind}"
        noise = np.random.default_rng(0).integers(0, 255, (n, 1000), np.uint8)
        if kind == "compressed":  # half of each sample zeros
            noise[:, 500:] = 0
        write_dataset(({"i": i, "x": noise[i]} for i in range(n)), url, shard_bytes=64_000, progress=False)
        cache = NodeCache(CacheConfig(ram_bytes="4MB", ssd_bytes="8MB", ram_dir=f"{tmp_path}/{kind}-ram",
                                      ssd_dir=f"{tmp_path}/{kind}-ssd"))  # each its own: no other dataset in it
        ds = StreamingDataset(url, cache=cache, seed=5, batch_size=32)
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            assert sorted(i for b in ds for i in b["i"].tolist()) == list(range(n))
        c = ds._consumer
        assert c is not None and c.plan.rows is not None and not c.plan.parts, "epoch 1 is a node mix"
        chunks[kind], inflation[kind] = len(set(c.plan.run_starts.tolist())), ds._inflation
        ds.close()
        cache.close()
    assert inflation["raw"] == 0.0 and inflation["compressed"] > 1.5, inflation
    assert chunks["raw"] < chunks["compressed"], (chunks, inflation)


def test_the_next_plan_is_taken_where_it_plans_the_same() -> None:
    """A plan built ahead (datacache.pytorch.next_plan) is taken for the spec it was built for, and
    for one that differs only in a budget its share fits either way; any other difference, or a
    budget that decides otherwise, plans again. The plan taken is the one ``build_plan`` gives; what
    it opened is handed over once, and closed by ``close`` where it is not taken."""
    from datacache.pytorch.next_plan import NextEpoch, expected_spec, same_plan

    class Opened:
        closed = False

        def close(self) -> None:
            self.closed = True

    counts = np.full(12, 50)
    cold = PlanSpec(seed=2, epoch=0, num_workers=2, worker_id=1, batch_size=8, mix_bytes=600, mix_from=1,
                    chunk_bytes=64, part_bytes=40, part_narrow=2, part_strata=3)
    warm = expected_spec(cold)
    assert (warm.epoch, warm.part_bytes, warm.part_narrow, warm.part_strata, warm.mix_from) == (1, 0, 0, 0, 1)
    assert build_plan(counts, warm).rows is not None, "the warm epoch is a node mix"
    opened: list[Opened] = []
    ahead = NextEpoch(counts, warm, lambda plan: opened.append(Opened()) or opened[-1])
    assert same_plan(counts, replace(warm, mix_bytes=10_000), warm)
    assert not same_plan(counts, replace(warm, mix_bytes=599), warm), "599 < 600 samples: no mix"
    assert not same_plan(counts, replace(warm, chunk_bytes=65), warm)
    assert ahead.take(replace(warm, epoch=2)) == (None, None)
    (got, consumer), want = ahead.take(replace(warm, mix_bytes=900)), build_plan(counts, warm)
    assert got is not None and got.samples.tolist() == want.samples.tolist()
    assert got.runs == want.runs and got.steps.tolist() == want.steps.tolist()
    assert consumer is opened[0] and ahead.take(warm)[1] is None, "handed over once"
    ahead.close()
    assert not opened[0].closed, "closed what was taken"
    ahead = NextEpoch(counts, warm, lambda plan: opened.append(Opened()) or opened[-1])
    assert ahead.take(warm, opened=False)[1] is None
    ahead.close()
    ahead.close()
    assert len(opened) == 2 and opened[1].closed


def _spy_plans(log: str) -> Any:
    """``build_plan`` that first appends "plan <epoch>" of each whole plan to the file ``log``."""
    def spy(counts: Any, spec: PlanSpec, order: Any = None, **kw: Any) -> Any:
        if not kw:
            with open(log, "a") as f:
                f.write(f"plan {spec.epoch}\n")
        return build_plan(counts, spec, order=order, **kw)
    return spy


def _spy_consumers(log: str) -> Any:
    """``Consumer`` that first appends "<thread name> <epoch>" of each one made to the file ``log``."""
    import threading

    from datacache.read.consumer import Consumer

    def spy(**kw: Any) -> Any:
        with open(log, "a") as f:
            f.write(f"{threading.current_thread().name} {kw['epoch']}\n")
        return Consumer(**kw)
    return spy


@pytest.mark.timeout(180)
def test_a_persistent_worker_plans_its_next_epoch_while_it_waits(sorted_url: str, tmp_path: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Persistent DataLoader workers plan each warm epoch after their last batch of the epoch
    before, and open its consumer there, every shard being cached (datacache.pytorch.next_plan):
    from epoch 2 on no worker plans or opens when its epoch starts, and every epoch's batches are
    those of workers that plan each epoch afresh (fresh workers, a cache of their own)."""
    from datacache import DataLoader
    from datacache.pytorch import dataset as dataset_module

    runs = {}
    for persistent in (True, False):
        log = tmp_path / f"plans-{persistent}"
        monkeypatch.setattr(dataset_module, "build_plan", _spy_plans(str(log)))  # the workers fork with them
        monkeypatch.setattr(dataset_module, "Consumer", _spy_consumers(str(log)))
        cache = NodeCache(CacheConfig(ram_bytes="4MB", ssd_bytes="8MB", ram_dir=f"{tmp_path}/{persistent}-ram",
                                      ssd_dir=f"{tmp_path}/{persistent}-ssd"))
        ds = StreamingDataset(sorted_url, cache=cache, seed=5)
        loader = DataLoader(ds, batch_size=32, num_workers=2, persistent_workers=persistent)
        epochs = []
        for epoch in range(4):
            ds.set_epoch(epoch)
            epochs.append([b["i"].tolist() for b in loader])
            assert sorted(i for b in epochs[-1] for i in b) == list(range(N)), f"epoch {epoch}: not every sample once"
        del loader
        ds.close()
        cache.close()
        runs[persistent] = (epochs, Counter(tuple(line.split()) for line in log.read_text().splitlines()))
    assert runs[True][0] == runs[False][0], "a plan built ahead changed the batches"
    fresh, persistent = runs[False][1], runs[True][1]
    assert {k[1] for k in fresh} == {"0", "1", "2", "3"} and set(fresh.values()) == {2}, fresh  # the spies see all
    assert persistent[("plan", "0")] == 2 and persistent[("MainThread", "0")] == 2, persistent
    for epoch in ("2", "3"):
        assert persistent[("plan", epoch)] == persistent[("MainThread", epoch)] == 0, persistent
        assert persistent[("datacache-next-epoch", epoch)] == 2, persistent


@pytest.mark.parametrize("bs", [8, 100, 256])
def test_a_node_mixes_first_chunk_holds_the_first_batch(bs: int) -> None:
    """The first batch of a node-mixed consumer waits for its first chunk's runs only: that chunk
    holds at least a batch (at least ``FIRST_CHUNK`` positions), the next ones grow from it."""
    from datacache.plan.node_shuffle import FIRST_CHUNK, MIX_GROWTH

    counts = np.full(10, 3000)
    spec = PlanSpec(seed=1, epoch=1, num_workers=2, batch_size=bs, mix_bytes=10**9, chunk_bytes=10**6)
    plan = build_plan(counts, spec)
    assert plan.rows is not None, "a node mix"
    starts = sorted(set(plan.run_starts.tolist()))
    first = max(FIRST_CHUNK, bs)
    assert starts[:3] == [0, first, first * (1 + MIX_GROWTH)], starts[:3]


def test_rows_read_in_place_take_as_few_chunks_as_the_first_batch_allows() -> None:
    """Rows read in place (every block raw) cost a chunk one run per shard and no memory: after the
    first chunk (a batch) one chunk takes the rest, and where the first touches every shard already
    it is the whole chunk: one run per shard. Other rows grow their chunks 16 times a step."""
    assert chunk_bounds(10_000, 5000, 16, 32, in_place_shards=30).tolist() == [0, 5000]
    assert chunk_bounds(10_000, 5000, 16, 32, in_place_shards=100).tolist() == [0, 32, 5032]
    assert chunk_bounds(10_000, 5000, 16, 32).tolist() == [0, 32, 544, 5544]
    counts = np.full(10, 3000)
    spec = PlanSpec(seed=1, epoch=1, num_workers=2, batch_size=32, mix_bytes=10**9, chunk_bytes=10**6)
    runs = {flag: build_plan(counts, replace(spec, in_place=flag)).runs for flag in (False, True)}
    assert len(runs[True]) == 10 and len(runs[False]) > 30, {k: len(v) for k, v in runs.items()}


def _no_guess(spec: PlanSpec) -> PlanSpec:
    raise RuntimeError("no guess today")


@pytest.mark.timeout(180)
def test_a_next_epoch_that_cannot_start_ahead_starts_as_before(sorted_url: str, cache: NodeCache,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting the next epoch ahead is a guess: where it fails, the epoch that was read ends without
    an error and the next one starts as without it, every sample once."""
    from datacache import DataLoader
    from datacache.pytorch import dataset as dataset_module

    monkeypatch.setattr(dataset_module, "expected_spec", _no_guess)  # the workers fork with it
    ds = StreamingDataset(sorted_url, cache=cache, seed=5)
    loader = DataLoader(ds, batch_size=32, num_workers=2, persistent_workers=True)
    for epoch in range(3):
        ds.set_epoch(epoch)
        assert sorted(i for b in loader for i in b["i"].tolist()) == list(range(N)), f"epoch {epoch}"
    del loader
    ds.close()
