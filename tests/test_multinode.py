"""Real multi-node runs on one machine: every "node" is a set of rank processes started with the
launcher variables set by hand (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), each node with its
own RAM and SSD directories, all reading through one metering SlowLink proxy.

- sticky reads: 2 nodes x 2 ranks x 2 DataLoader workers, cache 0.6 D per node, 3 epochs: epochs
  2-3 cost <= 1 % of D at the proxy, and every epoch is exactly once across all ranks;
- elastic resume: 3 nodes, stopped mid-epoch; resumed on 2 nodes with the third node's cache gone:
  the epoch stays exactly once, and the next full epoch reads <= 1.1 x what the lost node held;
- launchers agree: Slurm and Open MPI variables give the same node split as torchrun's;
- D - C under multi-process stress: 1 node x 2 ranks x 2 DataLoader workers (4 reader processes and
  2 rank processes on one node cache), cache D / 2, the clairvoyant default, 3 epochs: epochs 2-3
  each cost <= 1.05 x (D - C) at the proxy, every epoch exactly once, every byte checked.
"""
from __future__ import annotations

import json
import shutil
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from datacache import StreamingDataset, write_dataset
from datacache.dist import detect
from datacache.plan.epoch import build_plan
from tests.helpers import faults as H
from tests.helpers.nodes import TIMEOUT, Job, exactly_once
from tools.s3server import free_ports
from tools.scale_model import predict_bytes

ROOT = Path(__file__).resolve().parents[1]


def _dataset(s3_server: Any, n: int) -> tuple[str, Any]:
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/"
    rng = np.random.default_rng(0)  # incompressible: 1 KB a sample, ~48 KB shards
    m = write_dataset(({"i": i, "x": rng.integers(0, 2**31 - 1, 256, dtype=np.int32)} for i in range(n)), url,
                      shard_bytes=48 << 10, storage_options=s3_server.storage_options(), progress=False)
    return url, m


def _base(url: str, s3_server: Any, link: Any, ram_bytes: int) -> dict[str, Any]:
    return {"url": url, "storage_options": s3_server.storage_options(link.endpoint_url), "seed": 3,
            "ram_bytes": ram_bytes, "ssd_bytes": 0, "num_workers": 0}


@pytest.mark.timeout(TIMEOUT + 60)
def test_sticky_reads_two_nodes(s3_server: Any, slowlink: Any, tmp_path: Path) -> None:
    """2 nodes x 2 ranks x 2 workers, 0.6 D of cache per node: after epoch 1 the nodes read
    (almost) nothing, where the global reshuffle re-reads about a third of D every epoch."""
    n = 3000
    url, m = _dataset(s3_server, n)
    d = m.total_bytes
    link = slowlink(bandwidth=0, latency=0.0)
    nodes = [tmp_path / f"node{k}" for k in range(2)]
    job = Job(tmp_path, "run", link, _base(url, s3_server, link, int(0.6 * d)), nodes, per_node=2,
              epochs=[0, 1, 2], num_workers=2)
    snaps = job.run()
    for e in range(3):
        exactly_once(job.ids(e), n)
    assert job.ids(0) != job.ids(1), "epochs do not reshuffle"
    assert snaps[0]["bytes_down"] >= d
    later = snaps[2]["bytes_down"] - snaps[0]["bytes_down"]
    # tools/scale_model's prediction from the plan: each node's share in epoch 1, nothing after
    predicted = predict_bytes(np.array([s.samples for s in m.shards]), np.array([s.bytes for s in m.shards]),
                              nodes=2, ranks=2, workers=2, cache=int(0.6 * d), epochs=3, seed=3)
    assert predicted[1:] == [0, 0] and predicted[0] <= snaps[0]["bytes_down"] <= 1.05 * predicted[0]
    print(f"sticky: D={d} B, epoch 1 {snaps[0]['bytes_down']} B (model {predicted[0]} B), epochs 2-3 {later} B")
    assert later <= 0.01 * d, f"epochs 2-3 read {later} B of D = {d} B"
    assert json.loads((job.out / "layout_rank3.json").read_text()) == {"dp_rank": 3, "dp_size": 4, "num_nodes": 2}


@pytest.mark.timeout(2 * TIMEOUT + 60)
@pytest.mark.parametrize("workers", [0, 2])
def test_elastic_resume_three_to_two_nodes(s3_server: Any, slowlink: Any, tmp_path: Path, workers: int) -> None:
    """Saved in each rank's main process (rank 0's state resumed), or in each rank's 2 DataLoader
    workers (StatefulDataLoader; every rank's state resumed), and resumed on 2 nodes."""
    from datacache.plan.resume import rank_state

    n = 3000
    url, m = _dataset(s3_server, n)
    d = m.total_bytes
    link = slowlink(bandwidth=0, latency=0.0)
    nodes = [tmp_path / f"node{k}" for k in range(3)]
    stop = 400  # of the 1,000 samples each rank reads in epoch 1 (25 batches of 16 with workers)
    first = Job(tmp_path, "three", link, _base(url, s3_server, link, int(0.6 * d)), nodes, per_node=1,
                epochs=[0, 1], stop=[1, stop], num_workers=workers)
    first.run()
    lost = first.stats(1, 2)["used_ram"]  # what the third node holds
    states = [json.loads((first.out / f"state_rank{r}.json").read_text()) for r in range(3)]
    assert [sum(rank_state(s).consumed) for s in states] == [stop] * 3
    # a node-mixed epoch: each node's share (D / 3) fits its cache, so epoch 1 is one permutation
    # per node (datacache.plan.node_shuffle), and the resume below continues that order on other nodes
    assert all(rank_state(s).mix[0] > 0 and rank_state(s).mix[1] <= 1 for s in states), "epoch 1 not node-mixed"
    shutil.rmtree(nodes[2])  # the third node is gone, and its cache with it
    state_path = tmp_path / "state.json"
    state_path.write_text(json.dumps(states if workers else states[0]))
    resumed = Job(tmp_path, "two", link, _base(url, s3_server, link, int(0.6 * d)), nodes[:2], per_node=1,
                  epochs=[1, 2], resume=str(state_path), num_workers=workers)
    snaps = resumed.run()
    epoch1 = first.ids(1) + resumed.ids(1)
    seen = Counter(i for ids in epoch1 for i in ids)
    assert set(seen) == set(range(n)) and sum(c - 1 for c in seen.values()) < 2, "epoch 1 is not exactly once"
    exactly_once(resumed.ids(2), n)
    next_epoch = snaps[1]["bytes_down"] - snaps[0]["bytes_down"]
    assert lost > 0.25 * d
    print(f"elastic: D={d} B, lost node held {lost} B, next full epoch {next_epoch} B")
    assert next_epoch <= 1.1 * lost, f"the next full epoch read {next_epoch} B; the lost node held {lost} B"
    assert json.loads((resumed.out / "layout_rank1.json").read_text())["num_nodes"] == 2


@pytest.mark.timeout(TIMEOUT + 60)
def test_one_node_four_readers_fetch_d_minus_c(s3_server: Any, slowlink: Any, tmp_path: Path) -> None:
    """2 ranks x 2 workers share one node cache of D / 2 with the default (clairvoyant) policy:
    the node's schedule covers all four consumers, so each epoch after the first fetches about
    what the cache cannot hold, D - C (LRU: ~0.75 D), with no sample lost, repeated or corrupted.
    The ranks run as a data-parallel job does: in step (an all-reduce per batch), with persistent
    workers. (Ranks left to run free drift apart by up to half an epoch here, and the node's one
    plan clock then lets the one ahead evict the shards the other is about to read: README, "The
    cache and its bound".)"""
    n, size = 3072, 3000  # 96 shards of ~96 KB: D ~ 9 MB
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/"
    m = H.write(url, s3_server.storage_options(), n, size, shard_bytes=32 * size)
    d = m.total_bytes
    c = d // 2
    link = slowlink()
    job = Job(tmp_path, "node", link, _base(url, s3_server, link, c), [tmp_path / "node0"], per_node=2,
              epochs=[0, 1, 2], num_workers=2, payload_size=size, persistent_workers=True,
              lockstep=free_ports(1)[0])
    snaps = job.run()
    per_epoch = [snaps[0]["bytes_down"]] + [b["bytes_down"] - a["bytes_down"] for a, b in zip(snaps, snaps[1:])]
    print(f"\none node, 2 ranks x 2 workers: D = {d} B, D - C = {d - c} B, remote bytes per epoch {per_epoch}")
    for e in range(3):
        exactly_once(job.ids(e), n)
        assert [job.stats(e, r)["bad"] for r in range(2)] == [0, 0], f"epoch {e}: samples with wrong bytes"
    assert job.ids(0) != job.ids(1), "epochs do not reshuffle"
    assert d <= per_epoch[0] <= 1.05 * d
    for e in (1, 2):
        assert per_epoch[e] <= 1.05 * (d - c), f"epoch {e + 1} read {per_epoch[e]} B; D - C = {d - c} B"


def _launcher_envs(rank: int, nodes: int, per_node: int) -> dict[str, dict[str, str]]:
    world, local, node = nodes * per_node, rank % per_node, rank // per_node
    return {
        "torchrun": {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                     "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(node)},
        "slurm": {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(local),
                  "SLURM_NNODES": str(nodes), "SLURM_NODEID": str(node),
                  "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})"},
        "slurm-nnodes-only": {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(local),
                              "SLURM_NNODES": str(nodes)},
        "openmpi": {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world),
                    "OMPI_COMM_WORLD_LOCAL_RANK": str(local), "OMPI_COMM_WORLD_LOCAL_SIZE": str(per_node)},
    }


def test_launchers_agree_on_the_node_split(small_dataset: tuple[str, dict[str, Any], Any], tmp_path: Path) -> None:
    """Every launcher's variables give each rank the same node, node count and shards to read."""
    from datacache import CacheConfig

    url, opts, _ = small_dataset
    cache = CacheConfig(ram_bytes="4MB", ssd_bytes=0, ram_dir=str(tmp_path / "ram"), ssd_dir=str(tmp_path / "ssd"))
    nodes, per_node = 3, 2
    splits: dict[str, list[tuple[int, int, int, list[int]]]] = {}
    for rank in range(nodes * per_node):
        for name, env in _launcher_envs(rank, nodes, per_node).items():
            info = detect(env)
            ds = StreamingDataset(url, storage_options=opts, cache=cache, dist=info)
            shards = sorted({r[0] for r in build_plan(ds.counts, ds._spec(1, 0), shards_only=True).runs})
            splits.setdefault(name, []).append((info.node_rank, ds.num_nodes, ds.dp_rank, shards))
            ds.close()
    assert all(s == splits["torchrun"] for s in splits.values()), splits
    assert [s[:2] for s in splits["torchrun"]] == [(k // per_node, nodes) for k in range(nodes * per_node)]


def test_replication_groups_on_several_nodes(small_dataset: tuple[str, dict[str, Any], Any], tmp_path: Path) -> None:
    """2 nodes x 2 ranks, replication=2: each node is one data-parallel group whose two ranks get
    identical samples; the nodes read their own shards (5 of 8 samples: 3 and 2, and one shard
    whose samples they split), every sample once."""
    from datacache import CacheConfig
    from datacache.dist import DistInfo

    url, opts, m = small_dataset
    cache = CacheConfig(ram_bytes="4MB", ssd_bytes=0, ram_dir=str(tmp_path / "ram"), ssd_dir=str(tmp_path / "ssd"))
    plans = []
    for rank in range(4):
        ds = StreamingDataset(url, storage_options=opts, cache=cache, replication=2,
                              dist=DistInfo(rank, 4, rank % 2, 2))
        assert (ds.dp_rank, ds.dp_size, ds.num_nodes) == (rank // 2, 2, 2)
        plans.append(build_plan(ds.counts, ds._spec(1, 0)))
        ds.close()
    assert np.array_equal(plans[0].samples, plans[1].samples) and np.array_equal(plans[2].samples, plans[3].samples)
    shared = {r[0] for r in plans[0].runs} & {r[0] for r in plans[2].runs}
    assert len(shared) <= 1, "more than the one shard whose samples balance the nodes"
    assert sorted(plans[0].samples.tolist() + plans[2].samples.tolist()) == list(range(m.num_samples))
