"""Composed mixes (batching="stratified" / "per_stream") on several nodes: node-sticky, as the
single-dataset plan and the random mix are. Each node reads the shards it owns for the run
(``datacache.mixing.plan``), epoch after epoch, while the batches keep their composition and every
epoch its exact per-stream counts."""
from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from datacache import CacheConfig, NodeCache, Stream, StreamingDataset, write_dataset
from datacache.dist import DistInfo
from datacache.mixing.plan import MixPlan, stream_owner
from datacache.plan.epoch import PlanSpec, build_plan

BATCHINGS = ("stratified", "per_stream")


def _epoch_reads(mix: MixPlan, epoch: int, nodes: int, ranks: int, batch: int, seed: int,
                 placement: str = "node", drop_last: bool = False) -> tuple[list[int], set[tuple[int, int, int]]]:
    """(every rank's samples in order, the (node, stream, real shard) runs read) of one epoch."""
    read: list[int] = []
    used: set[tuple[int, int, int]] = set()
    for r in range(nodes * ranks):
        spec = PlanSpec(seed=seed, epoch=epoch, shuffle=False, dp_size=nodes * ranks, dp_rank=r, num_nodes=nodes,
                        batch_size=batch, composed=True, placement=placement, drop_last=drop_last)
        plan = build_plan(mix.counts, spec, order=mix.epoch_order(spec))
        samples = plan.samples
        for a in range(0, len(samples), batch):
            got = np.bincount(mix.stream_of_samples(samples[a:a + batch]), minlength=len(mix.draws))
            if mix.batching == "stratified" and a + batch <= len(samples) and r < nodes * ranks - 1:
                share = batch * np.array(mix.draws) / mix.epoch_size
                assert (np.abs(got - share) < 1).all(), (got, share)
        if mix.batching == "per_stream":
            cuts = mix.batch_cuts(samples, batch)
            for a, b in zip([0, *cuts[:-1]], cuts):
                assert len(set(mix.stream_of_samples(samples[a:b]).tolist())) == 1
        used |= {(r // ranks, int(mix.stream_of[s]), int(mix.real_of[s])) for s, _, _ in plan.runs}
        read += samples.tolist()
    return read, used


@pytest.mark.parametrize("batching", BATCHINGS)
@pytest.mark.parametrize("seed, nodes, drop_last, repeat, sampling", [
    (0, 2, False, 2.0, "balanced"), (1, 4, False, 2.0, "balanced"), (2, 4, True, 2.0, "balanced"),
    (3, 3, False, 1.5, "fixed"), (4, 2, False, 1.5, "balanced"), (5, 4, True, 1.5, "balanced")])
def test_composed_mix_reads_the_same_shards_on_each_node_every_epoch(batching: str, seed: int, nodes: int,
                                                                     drop_last: bool, repeat: float,
                                                                     sampling: str) -> None:
    """Three streams, the third drawn ``repeat`` times its size, 2 ranks a node. Whole copies, or
    a fixed subset: after epoch 0 no node reads a shard it did not read in epoch 0. A balanced
    subset (a new one each epoch) moves a few shards' samples between nodes: at most a tenth of
    the runs are new (the global placement: more than a quarter). A node reads few shards that
    another node owns, and every epoch holds each stream's draw exactly."""
    rng = np.random.default_rng(seed)
    shards = [rng.integers(20, 30, 24), rng.integers(20, 30, 16), rng.integers(20, 30, 6)]
    draws = [int(shards[0].sum()), int(shards[1].sum()), int(repeat * shards[2].sum())]
    mix = MixPlan(shards, draws, batching=batching, sampling=sampling, seed=seed, shuffle=True)
    owners = [stream_owner(c, nodes, seed, i) for i, c in enumerate(mix.shard_counts)]
    first: set[tuple[int, int, int]] = set()
    for epoch in range(4):
        read, used = _epoch_reads(mix, epoch, nodes, 2, 8, seed, drop_last=drop_last)
        if drop_last:
            assert len(read) == sum(draws) // (2 * nodes) // 8 * 8 * 2 * nodes
        else:
            counts = np.bincount(mix.stream_of_samples(np.array(read[:sum(draws)])), minlength=3).tolist()
            assert counts == draws and len(set(read)) == sum(draws)
        foreign = sum(1 for node, i, j in used if owners[i][j] != node)
        assert foreign <= 3 * nodes, f"epoch {epoch}: {foreign} of {len(used)} runs on another node's shards"
        _, spread = _epoch_reads(mix, epoch, nodes, 2, 8, seed, placement="global", drop_last=drop_last)
        if epoch == 0:
            first = used
            continue
        new = used - first
        if repeat == int(repeat) or sampling == "fixed":
            assert not new, f"epoch {epoch}: new shards on their nodes: {sorted(new)[:5]}"
        else:
            assert len(new) <= 0.1 * len(used), f"epoch {epoch}: {len(new)} of {len(used)} runs new"
        assert len(spread - first) > 0.25 * len(spread)  # what a global layout does


# ---------------------------------------------------------------------------------------------- real nodes
N = 360


@pytest.fixture(scope="module")
def mix_urls(s3_server: Any) -> list[tuple[str, int]]:
    """Three streams of incompressible samples: [(url, total bytes)]."""
    out = []
    for width, n, seed in ((256, N, 1), (160, N, 2), (200, N // 3, 3)):
        rng = np.random.default_rng(seed)
        url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/"
        m = write_dataset(({"i": 1000 * seed + i, "x": rng.integers(0, 256, width, dtype=np.uint8)} for i in range(n)),
                          url, shard_bytes=2048, storage_options=s3_server.storage_options(), progress=False)
        assert len(m.shards) >= 8
        out.append((url, m.total_bytes))
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("batching", BATCHINGS)
def test_two_nodes_read_nothing_after_the_first_epoch(mix_urls: list[tuple[str, int]], s3_server: Any, tmp_path: Path,
                                                      batching: str) -> None:
    """2 nodes x 2 ranks, each node its own cache of 0.6 of the streams' bytes (more than its
    share), the third stream read twice: epochs 2-3 read <= 1 % of D from the store on the
    two nodes together, and every epoch holds each stream's draw exactly."""
    opts = s3_server.storage_options()
    total = sum(d for _, d in mix_urls)
    draws = {1: N, 2: N, 3: N // 3 * 2}
    configs = [CacheConfig(ram_bytes=int(0.6 * total), ssd_bytes=0, ram_dir=str(tmp_path / f"ram{k}"),
                           ssd_dir=str(tmp_path / f"ssd{k}")) for k in range(2)]
    with NodeCache(configs[0]) as c0, NodeCache(configs[1]) as c1:
        caches = [c0, c1]
        sets = [StreamingDataset(streams=[Stream(u, repeat=k, storage_options=opts) for (u, _), k in
                                          zip(mix_urls, (1, 1, 2))],
                                 batch_size=8, batching=batching, cache=caches[r // 2], seed=4,
                                 dist=DistInfo(rank=r, world_size=4, local_rank=r % 2, local_world_size=2))
                for r in range(4)]
        per_epoch, seen = [], 0
        for epoch in range(3):
            ids: list[int] = []
            for ds in sets:
                ds.set_epoch(epoch)
                ids += [i for b in ds for i in b["i"].tolist()]
            assert Counter(i // 1000 for i in ids) == draws
            now = sum(c.stats()["remote_bytes"] for c in caches)
            per_epoch.append(now - seen)
            seen = now
        for ds in sets:
            ds.close()
    print(f"{batching}: remote bytes per epoch {per_epoch} of D = {total}")
    assert per_epoch[0] >= total  # every shard crossed once at least
    assert sum(per_epoch[1:]) <= 0.01 * total, per_epoch
