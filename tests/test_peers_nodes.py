"""The peer tier with real node processes on 127.0.0.1 (``tests/helpers/nodes.py``): every node its
own cache directories and its own peer server behind a metering SlowLink (the peers' bytes are
counted on the wire, as the store's are at the store's link).

- global placement, 4 nodes x 0.3 D, 2 DataLoader workers each: epochs 2-3 read <= 1 % of D from
  the store, every epoch exactly once; then a second job on 2 other nodes, reading the first job's
  nodes as read-only peers, reads <= 1 % of D from the store in its first epoch; in its second, one
  of the first job's nodes is killed mid-epoch and its cache removed: the epoch completes exactly once;
- node-sticky, 3 -> 4 nodes: the joining node's share comes from the other nodes' caches, the store
  answers <= 1 % of D; the joining node's cache (0.1 D) is smaller than its share (0.25 D) and the
  others have room: its second epoch reads <= 1 % of D from the store too.
"""
from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from datacache import CacheConfig, PeerConfig, StreamingDataset, open_store, write_dataset
from datacache.dist import DistInfo
from datacache.manifest import MANIFEST_NAME
from tests.helpers.nodes import TIMEOUT, Job, exactly_once
from tools.s3server import free_ports
from tools.slowlink import SlowLink

N = 2000


def _dataset(s3_server: Any) -> tuple[str, Any]:
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/"
    rng = np.random.default_rng(0)  # incompressible: 1 KB a sample, ~8 KB shards (250 of them)
    m = write_dataset(({"i": i, "x": rng.integers(0, 2**31 - 1, 256, dtype=np.int32)} for i in range(N)), url,
                      shard_bytes=8 << 10, storage_options=s3_server.storage_options(), progress=False)
    return url, m


class Nodes:
    """``n`` node addresses: each node's server binds a free port behind its own metering SlowLink,
    whose address is the one the peers list."""

    def __init__(self, n: int) -> None:
        self.ports = free_ports(n)
        self.links = [SlowLink("127.0.0.1", p, bandwidth=0, latency=0.0).start() for p in self.ports]
        self.peers = [f"127.0.0.1:{link.port}" for link in self.links]
        self.binds = [f"127.0.0.1:{p}" for p in self.ports]

    def bytes(self) -> int:
        return sum(link.snapshot()["bytes_down"] for link in self.links)

    def stop(self) -> None:
        for link in self.links:
            link.stop()


def _base(url: str, s3_server: Any, store: Any, ram: int, nodes: Nodes, token: str, **peers: Any) -> dict[str, Any]:
    return {"url": url, "storage_options": s3_server.storage_options(store.endpoint_url), "seed": 3,
            "ram_bytes": ram, "ssd_bytes": 0, "num_workers": 0, "binds": nodes.binds,
            "peers": {"peers": nodes.peers, "token": token, **peers}}


def _per_epoch(snaps: list[dict[str, int]], start: int = 0) -> list[int]:
    marks = [start] + [s["bytes_down"] for s in snaps]
    return [b - a for a, b in zip(marks, marks[1:])]


@pytest.mark.timeout(2 * TIMEOUT)
def test_global_placement_a_second_job_and_a_killed_peer(s3_server: Any, slowlink: Any, tmp_path: Path) -> None:
    url, m = _dataset(s3_server)
    d = m.total_bytes
    store = slowlink()
    a_nodes, b_nodes = Nodes(4), Nodes(2)
    a_dirs, b_dirs = [tmp_path / f"a{k}" for k in range(4)], [tmp_path / f"b{k}" for k in range(2)]
    job_a = job_b = None
    try:
        # no hedge to the store on a slow answer, no give-up on a slow connect or stall: the suite's load starves
        # the nodes' processes of CPU (a busy fresh clone: 3-7 fallbacks a node in epoch 2, 11 % of D from the
        # store), and hedging and timeouts have tests of their own; the store's bytes then measure placement
        relaxed = {"hedge_delay": 60.0, "connect_timeout": 20.0, "stall_timeout": 20.0}
        job_a = Job(tmp_path, "a", store, _base(url, s3_server, store, int(0.3 * d), a_nodes, "token-a-" + "1" * 24,
                                                **relaxed),
                    a_dirs, per_node=1, epochs=[0, 1, 2], num_workers=2, placement="global", linger=True)
        snaps, peer_marks = [], []
        for e in range(3):
            snaps.append(job_a.step(e))
            peer_marks.append(a_nodes.bytes())
        store_a, peer_a = _per_epoch(snaps), [peer_marks[0]] + list(np.diff(peer_marks))
        print(f"\njob A, global, 4 nodes x 0.3 D: D = {d} B, store bytes per epoch {store_a}, peer bytes {peer_a}")
        for e in range(3):
            print(f"epoch {e + 1}: owned shards held / owned, fallbacks, hedges, bytes from the store by node:",
                  [(s["owned_held"], s["owned"], s["peers_fallbacks"], s["peers_hedged"], s["peers_bytes_from_store"])
                   for s in (job_a.stats(e, r) for r in range(4))])
            exactly_once(job_a.ids(e), N)
        assert job_a.ids(1) != job_a.ids(2), "epochs do not reshuffle"
        gets = snaps[0]["gets"]  # a GET a shard (~8 KB: the answers' headers add ~10 %), the manifest once a rank
        print(f"epoch 1: {gets} GETs at the store for {len(m.shards)} shards")
        assert d <= store_a[0] <= 1.15 * d and gets <= len(m.shards) + 8, "epoch 1: one download a shard for the job"
        assert store_a[1] + store_a[2] <= 0.01 * d, \
            f"epochs 2-3 read {store_a[1:]} B from the store; D = {d} B; fallbacks:\n{job_a.fallbacks()}"
        assert min(peer_a[1:]) >= 0.5 * d, "the other nodes' shards did not come from their peers"
        stats = [job_a.stats(2, r) for r in range(4)]
        served = sum(s["peers_bytes_served"] for s in stats)  # the wire adds headers and the held summaries
        assert sum(s["peers_bytes_from_peers"] for s in stats) <= sum(peer_a) <= 1.15 * served
        assert all(s["bad"] == 0 and s["peers_corrupt"] == 0 and s["peers_nodes"] == 4 for s in stats)

        # job B: 2 other nodes, the same dataset, job A's nodes as read-only peers; A's node 3 dies mid-epoch 2
        mark = store.snapshot()["bytes_down"]
        # relaxed as job A's: B's store bytes then measure where its shards came from, not how busy the
        # machine was; a killed node refuses at once
        job_b = Job(tmp_path, "b", store, _base(url, s3_server, store, int(0.3 * d), b_nodes, "token-b-" + "2" * 24,
                                                readonly_peers=a_nodes.peers, readonly_token="token-a-" + "1" * 24,
                                                **relaxed),
                    b_dirs, per_node=1, epochs=[0, 1], placement="global", pause=[1, N // 8])
        first = job_b.step(0)
        job_b.wait_for("paused1")
        job_a.kill_node(3)
        shutil.rmtree(a_dirs[3])
        (job_b.out / "resume1").touch()
        second = job_b.step(1)
        store_b = _per_epoch([first, second], mark)
        print(f"job B, 2 nodes reading job A's: store bytes per epoch {store_b} (A's node 3 killed in epoch 2)")
        exactly_once(job_b.ids(0), N)
        exactly_once(job_b.ids(1), N)
        manifest = open_store(url, s3_server.storage_options()).size(MANIFEST_NAME)  # each rank reads it once
        shards_b = store_b[0] - 2 * manifest
        assert shards_b <= 0.01 * d, f"job B's first epoch read {shards_b} B of shards from the store; D = {d} B"
        assert all(job_b.stats(1, r)["bad"] == 0 for r in range(2))
        job_b.finish()
        job_a.finish()
        logs = "".join(p.read_text(errors="replace") for job in (job_a, job_b) for p in job.logs)
        assert "token-a-" not in logs and "token-b-" not in logs, "a token in a log"
    finally:
        for job in (job_a, job_b):
            if job is not None:
                job.kill()
        a_nodes.stop()
        b_nodes.stop()


@pytest.mark.timeout(2 * TIMEOUT)
def test_a_joining_node_takes_its_share_from_the_peers(s3_server: Any, slowlink: Any, tmp_path: Path) -> None:
    """A 3-node run fills nodes 0-2's caches with their shares (read here, one node after the other,
    as its nodes would); the 4-node run that follows, with the peer tier, reads node 3's share from
    them. Node 3's cache holds 0.1 D, less than its share (0.25 D): the others, with room, own the
    rest of its share, so its second epoch too reads nothing from the store."""
    url, m = _dataset(s3_server)
    d = m.total_bytes
    store = slowlink()
    dirs = [tmp_path / f"n{k}" for k in range(4)]
    for k in range(3):
        cache = CacheConfig(ram_bytes=int(0.5 * d), ssd_bytes=0, ram_dir=str(dirs[k] / "ram"),
                            ssd_dir=str(dirs[k] / "ssd"))
        ds = StreamingDataset(url, storage_options=s3_server.storage_options(store.endpoint_url), cache=cache, seed=3,
                              dist=DistInfo(k, 3, 0, 1), peers=PeerConfig(peers="off"))
        assert len([s["i"] for s in ds]) == len(ds)
        ds.close()
        ds.cache.close()
    cold = store.snapshot()["bytes_down"]
    four = Nodes(4)
    try:
        job = Job(tmp_path, "four", store, _base(url, s3_server, store, int(0.5 * d), four, "t" * 32), dirs,
                  per_node=1, epochs=[0, 1], ram_by_node=[int(0.5 * d)] * 3 + [int(0.1 * d)])
        manifest = open_store(url, s3_server.storage_options()).size(MANIFEST_NAME)  # each rank reads it once
        snaps = job.run()
        after = snaps[0]["bytes_down"] - cold - 4 * manifest
        second = snaps[1]["bytes_down"] - snaps[0]["bytes_down"]
        exactly_once(job.ids(0), N)
        exactly_once(job.ids(1), N)
        joined = job.stats(0, 3)
        small = job.stats(1, 3)
        print(f"node 3 (cache 0.1 D) owns {small['owned_bytes']} B of its share; its second epoch: store {second} B")
        assert small["owned_bytes"] <= 0.1 * d and second <= 0.01 * d
        print(f"\nnode-sticky 3 -> 4 nodes: D = {d} B, store {cold} B then {after} B; the new node's bytes: "
              f"{joined['peers_bytes_from_peers']} B from peers, {joined['peers_bytes_from_store']} B from the store, "
              f"peer links {four.bytes()} B")
        assert after <= 0.01 * d, f"the 4-node run read {after} B of shards from the store; D = {d} B"
        assert joined["peers_bytes_from_peers"] >= 0.2 * d and four.bytes() >= joined["peers_bytes_from_peers"]
    finally:
        four.stop()
