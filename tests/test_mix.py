"""Several datasets in one StreamingDataset (datacache.Stream): weights, exact per-epoch counts,
the three batching modes, bad input, and the node cache knowing every stream's plan. Streams live
on the session's S3 server (tests/conftest.py, tests/helpers/mix.py)."""
from __future__ import annotations

import uuid
from collections import Counter
from fractions import Fraction
from typing import Any

import pytest
from torch.utils.data import DataLoader

from datacache import Manifest, NodeCache, Stream, StreamingDataset, open_store
from datacache.mixing.streams import draw_counts, largest_remainder
from tests.helpers.mix import DRAWS, EPOCH, SIZES, B, check_epoch, stream_of, streams, write_stream, write_streams


@pytest.fixture(scope="module")
def stream_urls(s3_server: Any) -> list[str]:
    return write_streams(s3_server)


# ---------------------------------------------------------------------------------------------- weights
def test_proportions_keep_the_sum_by_largest_remainder() -> None:
    s = [Stream(f"s3://b/{n}", proportion=p) for n, p in (("a", 0.7), ("b", 0.2), ("c", 0.1))]
    assert draw_counts(s, [100, 50, 10], 1001) == [701, 200, 100]
    assert sum(draw_counts(s, [100, 50, 10], 7)) == 7
    # relative: only the ratio counts; epoch_size defaults to the streams' sizes summed
    assert draw_counts([Stream("s3://b/a", proportion=3), Stream("s3://b/b", proportion=1)], [10, 30], None) == [30, 10]
    assert largest_remainder([Fraction(1, 3)] * 3, 10) == [4, 3, 3]


def test_absolute_weights_and_the_union() -> None:
    s = [Stream("s3://b/a", repeat=2.5), Stream("s3://b/b", choose=7)]
    assert draw_counts(s, [10, 50], None) == [25, 7]
    assert draw_counts(s, [10, 50], 64) == [50, 14]  # an explicit epoch_size scales them, ratio kept
    assert draw_counts([Stream("s3://b/a"), Stream("s3://b/b")], [10, 50], None) == [10, 50]  # no weights


@pytest.mark.parametrize("make, match", [
    (lambda: [Stream("s3://b/a", proportion=0.5), Stream("s3://b/b", repeat=2)], "stream s3://b/b: repeat .*mixed"),
    (lambda: [Stream("s3://b/a", proportion=0.5), Stream("s3://b/b")], "stream s3://b/b: no weight .*mixed"),
    (lambda: [Stream("s3://b/a", proportion=0.5, repeat=1)], "stream s3://b/a: proportion and repeat"),
    (lambda: [Stream("s3://b/a", proportion=0)], "stream s3://b/a: proportion=0"),
    (lambda: [Stream("s3://b/a", repeat=-1.0)], "stream s3://b/a: repeat=-1.0"),
    (lambda: [Stream("s3://b/a", choose=2.5)], r"stream s3://b/a: choose=2.5, expected an int"),
    (lambda: [Stream("s3://b/a"), Stream("s3://b/a/")], "stream s3://b/a/: the same URL"),
])
def test_bad_weights_name_the_stream(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        draw_counts(make(), [10, 10], None)


# ---------------------------------------------------------------------------------------------- counts
def read_epoch(make: Any, dp_size: int, epoch: int, num_workers: int = 2) -> list[list[list[int]]]:
    """Every rank's batches of ``epoch`` (ids), each rank read through a DataLoader with workers."""
    out = []
    for r in range(dp_size):
        ds = make(dp_rank=r, dp_size=dp_size)
        ds.set_epoch(epoch)
        batches = [b["i"].tolist() for b in DataLoader(ds, batch_size=None, num_workers=num_workers)]
        assert len(batches) == len(ds), "len() is the batches a rank yields"
        out.append(batches)
        ds.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batching", ["random", "stratified", "per_stream"])
def test_exact_counts_every_epoch(stream_urls: list[str], s3_storage_options: dict[str, Any], cache: NodeCache,
                                  batching: str) -> None:
    def make(**kw: Any) -> StreamingDataset:
        return StreamingDataset(streams=streams(stream_urls, s3_storage_options), epoch_size=EPOCH, batch_size=B,
                                batching=batching, cache=cache, seed=5, **kw)

    subsets = []
    for epoch in range(3):
        ranks = read_epoch(make, 2, epoch)
        per = check_epoch([i for rank in ranks for b in rank for i in b])
        subsets.append({i for i in per if stream_of(i) == 0})
        for rank in ranks:
            for b in rank:
                got = Counter(stream_of(i) for i in b)
                if batching == "stratified":  # every batch of every rank: each stream's share within one
                    for s, d in enumerate(DRAWS):
                        assert abs(got[s] - len(b) * d / EPOCH) < 1, f"batch {b}: {dict(got)}"
                elif batching == "per_stream":
                    assert len(got) == 1, f"a per_stream batch mixes streams: {dict(got)}"
    assert subsets[0] != subsets[1] != subsets[2], "sampling='balanced' draws a new subset each epoch"


@pytest.mark.timeout(120)
def test_fixed_sampling_keeps_the_subset(stream_urls: list[str], s3_storage_options: dict[str, Any],
                                         cache: NodeCache) -> None:
    def make(**kw: Any) -> StreamingDataset:
        return StreamingDataset(streams=streams(stream_urls, s3_storage_options), epoch_size=EPOCH, batch_size=B,
                                sampling="fixed", cache=cache, seed=5, **kw)

    subsets = []
    for epoch in range(2):
        ids = [i for rank in read_epoch(make, 1, epoch, num_workers=0) for b in rank for i in b]
        check_epoch(ids)
        subsets.append(sorted(i for i in ids if stream_of(i) == 0))
    assert subsets[0] == subsets[1]


@pytest.mark.timeout(120)
def test_union_without_weights(stream_urls: list[str], s3_storage_options: dict[str, Any], cache: NodeCache) -> None:
    ds = StreamingDataset(streams=[Stream(u, storage_options=s3_storage_options) for u in stream_urls], cache=cache)
    ids = [int(s["i"]) for s in ds]
    assert sorted(ids) == sorted(1000 * s + i for s, n in enumerate(SIZES) for i in range(n))


@pytest.mark.timeout(120)
def test_datacache_dataloader_gives_the_batch_size(stream_urls: list[str], s3_storage_options: dict[str, Any],
                                                   cache: NodeCache) -> None:
    """datacache.DataLoader(ds, batch_size=B) over a stratified mix: the dataset's batched mode."""
    import datacache

    ds = StreamingDataset(streams=streams(stream_urls, s3_storage_options), epoch_size=EPOCH, batching="stratified",
                          cache=cache, seed=5)
    batches = [b["i"].tolist() for b in datacache.DataLoader(ds, batch_size=B, num_workers=2)]
    assert len(batches) == EPOCH // B
    for b in batches:
        got = Counter(stream_of(i) for i in b)
        assert all(abs(got[s] - B * d / EPOCH) < 1 for s, d in enumerate(DRAWS)), dict(got)
    check_epoch([i for b in batches for i in b])
    ds.close()


# ---------------------------------------------------------------------------------------------- schemas
@pytest.mark.timeout(120)
def test_schemas_differ_only_per_stream(s3_server: Any, stream_urls: list[str], s3_storage_options: dict[str, Any],
                                        cache: NodeCache) -> None:
    other = write_stream(s3_server, "captions", 30, 5000, field="y")
    mix = [Stream(stream_urls[0], storage_options=s3_storage_options),
           Stream(other, storage_options=s3_storage_options)]
    with pytest.raises(ValueError, match=f"stream {other}: field 'x' is missing, but .* in stream {stream_urls[0]}"):
        StreamingDataset(streams=mix, cache=cache, batch_size=B)
    ds = StreamingDataset(streams=mix, cache=cache, batch_size=B, batching="per_stream")
    batches = list(ds)
    assert all(set(b) in ({"i", "x"}, {"i", "y"}) for b in batches)
    assert sorted(i for b in batches for i in b["i"].tolist()) == sorted([*range(SIZES[0]), *range(5000, 5030)])


# ---------------------------------------------------------------------------------------------- bad input
def test_an_empty_stream_is_named(s3_server: Any, stream_urls: list[str], s3_storage_options: dict[str, Any],
                                  cache: NodeCache) -> None:
    empty = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/empty/"
    store = open_store(empty, s3_storage_options)
    store.write_bytes("manifest.json", Manifest(format="zstd", schema={"i": "int", "x": "ndarray"}, shards=()).to_json()
                      .encode())
    store.close()
    with pytest.raises(ValueError, match=f"stream {empty}: the dataset holds no samples"):
        StreamingDataset(streams=[Stream(stream_urls[0], storage_options=s3_storage_options),
                                  Stream(empty, storage_options=s3_storage_options)], cache=cache)


def test_bad_mixes_are_refused(stream_urls: list[str], s3_storage_options: dict[str, Any], cache: NodeCache) -> None:
    mix = streams(stream_urls, s3_storage_options)
    with pytest.raises(ValueError, match="epoch_size=12 .* is smaller than 2 ranks x batch 8"):
        StreamingDataset(streams=mix, epoch_size=12, batch_size=B, cache=cache, dp_rank=0, dp_size=2)
    with pytest.raises(ValueError, match="batching='stratified' composes batches: pass batch_size"):
        len(StreamingDataset(streams=mix, batching="stratified", cache=cache))
    with pytest.raises(ValueError, match="batching='mixed', expected one of random, stratified, per_stream"):
        StreamingDataset(streams=mix, batching="mixed", cache=cache)
    with pytest.raises(ValueError, match="pass a dataset url, or streams=.*not both"):
        StreamingDataset(stream_urls[0], streams=mix, cache=cache)
    with pytest.raises(ValueError, match="epoch_size, batching and sampling mix streams"):
        StreamingDataset(stream_urls[0], storage_options=s3_storage_options, epoch_size=10, cache=cache)
    with pytest.raises(ValueError, match=f"stream {stream_urls[2]}: its proportion draws 0"):
        StreamingDataset(streams=streams(stream_urls, s3_storage_options, (0.6, 0.399, 0.001)), epoch_size=100,
                         cache=cache)


# ---------------------------------------------------------------------------------------------- the cache
@pytest.mark.timeout(120)
def test_cache_knows_every_streams_plan(stream_urls: list[str], s3_storage_options: dict[str, Any],
                                        cache: NodeCache) -> None:
    ds = StreamingDataset(streams=streams(stream_urls, s3_storage_options), epoch_size=EPOCH, cache=cache, seed=5)
    it = iter(ds)
    ids = [int(next(it)["i"])]
    known = cache.policy.datasets()
    for src in ds.source.sources:
        assert known.get(src.manifest.dataset_id), f"the cache has no plan for stream {src.manifest.dataset_id}"
    check_epoch(ids + [int(s["i"]) for s in it])
    ds.close()


# ---------------------------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("seed", range(40))
def test_stratified_layout_is_exact_on_the_plans_batches(seed: int) -> None:
    """The stratified order, cut by the plan into ranks, workers and batches: every batch within
    one sample of each stream's share, the epoch's totals exact (random sizes, ranks, batches)."""
    import numpy as np

    from datacache.mixing.plan import MixPlan
    from datacache.plan.epoch import PlanSpec, build_plan

    rng = np.random.default_rng(seed)
    shards = [rng.integers(1, 9, rng.integers(1, 6)) for _ in range(rng.integers(2, 6))]
    sizes = [int(s.sum()) for s in shards]
    dp, batch, workers = int(rng.integers(1, 5)), int(rng.integers(1, 12)), int(rng.integers(1, 4))
    epoch = int(rng.integers(dp * batch, dp * batch + 3 * sum(sizes)))
    draws = draw_counts([Stream(f"s3://b/{i}", proportion=float(rng.random() + 0.05)) for i in range(len(shards))],
                        sizes, epoch)
    if min(draws) == 0:
        return
    mix = MixPlan(shards, draws, batching="stratified", sampling="balanced", seed=seed, shuffle=True)
    pad = -epoch % dp
    read: list[int] = []
    for r in range(dp):
        for w in range(workers):
            spec = PlanSpec(seed=seed, epoch=1, shuffle=False, dp_size=dp, dp_rank=r, num_workers=workers,
                            worker_id=w, batch_size=batch)
            samples = build_plan(mix.counts, spec, order=mix.epoch_order(spec)).samples
            for a in range(0, len(samples), batch):
                got = np.bincount(mix.stream_of_samples(samples[a:a + batch]), minlength=len(draws))
                share = len(samples[a:a + batch]) * np.array(draws) / epoch
                padded = pad and (r, w) == (dp - 1, workers - 1) and a + batch >= len(samples)
                assert (np.abs(got - share) < 1).all() or padded, (got, share)
            read += samples.tolist()
    assert len(read) == epoch + pad  # the padding: the last rank's last positions
    assert np.bincount(mix.stream_of_samples(np.array(read[:epoch])), minlength=len(draws)).tolist() == draws


@pytest.mark.timeout(200)
def test_stratified_batches_after_an_elastic_resume(stream_urls: list[str], s3_storage_options: dict[str, Any],
                                                    cache: NodeCache) -> None:
    """2 ranks read 3 batches each in epoch 2 and save; 3 ranks resume: every batch of every new
    rank holds each stream's share of what was left within one sample, the epoch's counts exact."""
    def make(**kw: Any) -> StreamingDataset:
        return StreamingDataset(streams=streams(stream_urls, s3_storage_options), epoch_size=EPOCH, batch_size=B,
                                batching="stratified", cache=cache, seed=5, **kw)

    before, states = [], []
    for r in range(2):
        ds = make(dp_rank=r, dp_size=2)
        ds.set_epoch(2)
        it = iter(ds)
        before += [i for _ in range(3) for i in next(it)["i"].tolist()]
        states.append(ds.state_dict())
        ds.close()
    left = Counter({s: DRAWS[s] - sum(1 for i in before if stream_of(i) == s) for s in range(3)})
    n_left = sum(left.values())
    after = []
    for r in range(3):
        ds = make(dp_rank=r, dp_size=3)
        ds.load_state_dict(states)
        for b in ds:
            got = Counter(stream_of(i) for i in b["i"].tolist())
            for s in range(3):
                assert abs(got[s] - len(b["i"]) * left[s] / n_left) < 1, f"rank {r}: {dict(got)} of {dict(left)}"
            after += b["i"].tolist()
        ds.close()
    assert len(after) == n_left  # 216 left: no padding for 3 ranks
    check_epoch(before + after)


@pytest.mark.parametrize("seed", range(6))
def test_random_mix_keeps_the_node_sticky_plan(seed: int) -> None:
    """batching="random" over 2 nodes x 2 ranks: every epoch has the exact per-stream counts, and
    each node reads its own shards (all but the few whose samples a node passes to another to even
    out the epoch's subset: a tenth of the shards read at most, half with placement="global")."""
    import numpy as np

    from datacache.mixing.plan import MixPlan
    from datacache.plan.epoch import PlanSpec, build_plan
    from datacache.plan.node_assign import assign_nodes

    rng = np.random.default_rng(seed)
    shards = [rng.integers(5, 9, 40), rng.integers(5, 9, 30), rng.integers(5, 9, 10)]
    sizes = [int(s.sum()) for s in shards]
    draws = draw_counts([Stream(f"s3://b/{i}", proportion=p) for i, p in enumerate((0.4, 0.4, 0.2))], sizes, 400)
    mix = MixPlan(shards, draws, batching="random", sampling="balanced", seed=seed, shuffle=True)
    weights = mix.counts * 1000
    owner = assign_nodes(weights, 2, seed)
    for epoch in range(3):
        read: list[int] = []
        used: set[tuple[int, int]] = set()  # (node, shard)
        for r in range(4):
            spec = PlanSpec(seed=seed, epoch=epoch, dp_size=4, dp_rank=r, num_nodes=2, shard_bytes=weights)
            plan = build_plan(mix.counts, spec, order=mix.epoch_order(spec))
            used |= {(spec.node, s) for s, _, _ in plan.runs}
            read += plan.samples.tolist()
        assert np.bincount(mix.stream_of_samples(np.array(read)), minlength=3).tolist() == draws
        foreign = sum(1 for node, s in used if owner[s] != node)
        assert foreign <= 0.1 * len(used), f"epoch {epoch}: {foreign} of {len(used)} shards foreign"
        runs = [(r // 2, s) for r in range(4) for s, _, _ in build_plan(mix.counts, PlanSpec(
            seed=seed, epoch=epoch, dp_size=4, dp_rank=r, num_nodes=2, placement="global"),
            order=mix.epoch_order(spec)).runs]
        assert sum(1 for node, s in runs if owner[s] != node) > 0.25 * len(runs)  # the global plan


@pytest.mark.parametrize("seed", range(20))
def test_per_stream_batches_are_one_stream_and_len_holds_for_any_workers(seed: int) -> None:
    """per_stream: every batch of every worker is one stream's, none longer than batch_size, and
    the rank's batch count is the same whatever the number of workers (what len() says)."""
    import numpy as np

    from datacache.mixing.plan import MixPlan
    from datacache.plan.epoch import PlanSpec, build_plan

    rng = np.random.default_rng(seed)
    shards = [rng.integers(1, 9, rng.integers(1, 6)) for _ in range(rng.integers(2, 5))]
    sizes = [int(s.sum()) for s in shards]
    dp, batch = int(rng.integers(1, 4)), int(rng.integers(2, 9))
    draws = draw_counts([Stream(f"s3://b/{i}", proportion=float(rng.random() + 0.1)) for i in range(len(shards))],
                        sizes, int(rng.integers(dp * batch, dp * batch + 2 * sum(sizes))))
    if min(draws) == 0:
        return
    mix = MixPlan(shards, draws, batching="per_stream", sampling="balanced", seed=seed, shuffle=True)
    for r in range(dp):
        counts = set()
        for workers in (1, 2, 3):
            n = 0
            for w in range(workers):
                spec = PlanSpec(seed=seed, shuffle=False, dp_size=dp, dp_rank=r, num_workers=workers, worker_id=w,
                                batch_size=batch)
                samples = build_plan(mix.counts, spec, order=mix.epoch_order(spec)).samples
                cuts = mix.batch_cuts(samples, batch)
                for a, b in zip([0, *cuts[:-1]], cuts):
                    assert 0 < b - a <= batch and len(set(mix.stream_of_samples(samples[a:b]).tolist())) == 1
                n += len(cuts)
            counts.add(n)
        assert len(counts) == 1, f"rank {r}: {counts} batches for 1, 2, 3 workers"
