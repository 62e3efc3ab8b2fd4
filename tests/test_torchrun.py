"""Real torchrun jobs (gloo) over the S3 fixture, reached through a metering SlowLink proxy.

- ``torchrun --standalone --nproc_per_node=2``, both ranks sharing one node cache: samples are split
  exactly once across ranks, each shard crosses the link once for the node in epoch 1, and epoch 2
  costs nothing; the same for the default part-mixed cold epoch, each block once for the node;
- two nodes, ``torchrun --nnodes 2 --node-rank 0/1`` on 127.0.0.1, each with its own cache
  directories: exactly once across all ranks, and epoch 2 reads <= 1 % of the dataset.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from datacache import write_dataset

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "helpers" / "torchrun_worker.py"
N = 2000
TIMEOUT = 240


def _log_tail(path: Path, n: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "<no log>"


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _dataset(s3_server: Any, **writer: Any) -> tuple[str, Any]:
    """N samples, written straight to the server: the link sees only the job's reads. ``writer``:
    the writer's options (e.g. ``block_bytes``)."""
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/"
    rng = np.random.default_rng(0)  # incompressible payload: ~48 KB shards
    m = write_dataset(({"i": i, "x": rng.integers(0, 2**31 - 1, 64, dtype=np.int32)} for i in range(N)), url,
                      shard_bytes=48 << 10, storage_options=s3_server.storage_options(), progress=False,
                      writer_options=writer or None)
    assert len(m.shards) >= 8
    return url, m


def _run(launchers: list[list[str]], cfg: dict[str, Any], tmp_path: Path, link: Any) -> tuple[dict, dict]:
    """Start one torchrun per entry of ``launchers`` (its arguments before the worker), wait for epoch 1
    on every rank, read the proxy's counters, let the job finish; (epoch 1's counters, the total)."""
    out = Path(cfg["out_dir"])
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    logs = [tmp_path / f"torchrun{k}.log" for k in range(len(launchers))]
    tails = lambda: "\n".join(f"--- {p.name}\n{_log_tail(p)}" for p in logs)  # noqa: E731
    deadline = time.monotonic() + TIMEOUT
    procs: list[subprocess.Popen] = []
    try:
        for args, log in zip(launchers, logs):
            with open(log, "wb") as logf:
                procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, str(WORKER),
                                               str(cfg_path)], cwd=ROOT, env=_env(), stdout=logf,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        while not (out / "epoch0.done").exists():
            assert all(p.poll() is None for p in procs), f"torchrun exited early:\n{tails()}"
            assert time.monotonic() < deadline, f"epoch 1 did not finish:\n{tails()}"
            time.sleep(0.05)
        epoch1 = link.snapshot()
        (out / "epoch0.go").touch()
        rcs = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)  # the job's own process group: torchrun and its ranks
                p.wait()
    assert rcs == [0] * len(procs), f"torchrun failed ({rcs}):\n{tails()}"
    return epoch1, link.snapshot()


def _exactly_once(out: Path, ranks: int) -> None:
    """Every epoch: each sample once across all ranks, equal shares; the epochs' orders differ."""
    orders = []
    for epoch in range(2):
        per_rank = [json.loads((out / f"rank{r}_epoch{epoch}.json").read_text()) for r in range(ranks)]
        assert all(len(p) == N // ranks for p in per_rank), f"epoch {epoch}: unequal ranks"
        assert sorted(sum(per_rank, [])) == list(range(N)), f"epoch {epoch}: not every sample once"
        orders.append(per_rank)
    assert orders[0] != orders[1]


def _one_node_job(s3_server: Any, slowlink: Any, tmp_path: Path, extra: dict[str, Any],
                  **writer: Any) -> tuple[Any, Path, dict, dict]:
    """``torchrun --standalone --nproc_per_node=2`` over a fresh dataset (``writer``: its writer's
    options) through a fast metering link, 2 epochs, ``extra`` in the ranks' config; checks every
    sample once; (manifest, out dir, epoch 1's link counters, the total)."""
    url, m = _dataset(s3_server, **writer)
    link = slowlink(bandwidth=500e6, latency=0.001)
    out, cache_dir = tmp_path / "out", tmp_path / "cache"
    out.mkdir()
    cfg = {"url": url, "storage_options": s3_server.storage_options(link.endpoint_url), "cache_dir": str(cache_dir),
           "out_dir": str(out), "epochs": 2, **extra}
    epoch1, total = _run([["--standalone", "--nproc_per_node=2"]], cfg, tmp_path, link)
    _exactly_once(out, 2)
    return m, out, epoch1, total


@pytest.mark.timeout(TIMEOUT + 30)
def test_torchrun_two_ranks_share_node_cache(s3_server: Any, slowlink: Any, tmp_path: Path) -> None:
    # whole shards, so that GETs count shards (a part mix's ranged reads: the next test)
    m, out, epoch1, total = _one_node_job(s3_server, slowlink, tmp_path, {"node_shuffle": "window"})
    shard_bytes = m.total_bytes
    manifest_bytes = len(m.to_json().encode())

    # epoch 1: each shard crossed the link once for the whole node (2 ranks x 2 workers)
    gets = epoch1["gets"]
    assert epoch1["bytes_down"] >= shard_bytes
    assert epoch1["bytes_down"] <= 1.01 * shard_bytes + 64 * 1024 * gets, (epoch1, shard_bytes)
    assert gets <= len(m.shards) + 4, f"{gets} GETs for {len(m.shards)} shards + 2 manifests"
    # tighter: headers are < 2 KB a request, and a shard fetched twice would add >= 1 shard
    overhead = 2 * manifest_bytes + 2048 * epoch1["requests"]
    assert epoch1["bytes_down"] <= shard_bytes + overhead < shard_bytes + min(s.bytes for s in m.shards[:-1]), \
        (epoch1, shard_bytes, overhead)
    # epoch 2: served from the node cache, nothing crossed the link
    assert total["gets"] - epoch1["gets"] == 0, (epoch1, total)
    assert total["bytes_down"] - epoch1["bytes_down"] == 0, (epoch1, total)

    # the node cache's own counters agree (shared by both ranks)
    stats = [json.loads((out / f"rank{r}_stats.json").read_text()) for r in range(2)]
    assert stats[1]["remote_bytes"] == shard_bytes and stats[1]["misses"] == len(m.shards)
    assert stats[1]["samples"] == 2 * N


@pytest.mark.timeout(TIMEOUT + 30)
def test_torchrun_two_ranks_part_mix_each_block_once_per_node(s3_server: Any, slowlink: Any, tmp_path: Path) -> None:
    """The default cold epoch, a part mix (``datacache.plan.part_shuffle``), read by 2 ranks x 2 workers of
    one node: every sample once, each shard's blocks crossed the link once for the node (ranged
    reads into the node's partial copies, single flight across the four processes), and the
    second epoch costs nothing. Counted in bytes at the proxy (ranged reads: GETs are blocks)."""
    m, out, epoch1, total = _one_node_job(s3_server, slowlink, tmp_path, {}, block_bytes=4096)  # ~12 blocks a shard
    shard_bytes = m.total_bytes
    manifest_bytes = len(m.to_json().encode())
    stats = [json.loads((out / f"rank{r}_stats.json").read_text()) for r in range(2)]
    # read part by part: partial copies, no whole-shard fetch
    assert shard_bytes <= stats[1]["partial_bytes"] <= 1.05 * shard_bytes, (stats[1], shard_bytes)
    assert epoch1["gets"] > 2 * len(m.shards), f"{epoch1['gets']} GETs: not ranged reads of blocks"
    # headers are < 2 KB a request; a shard read twice by the node would add a whole shard's bytes
    overhead = 2 * manifest_bytes + 2048 * epoch1["requests"]
    assert shard_bytes <= epoch1["bytes_down"] <= 1.05 * shard_bytes + overhead, (epoch1, shard_bytes, overhead)
    assert total["bytes_down"] - epoch1["bytes_down"] == 0, (epoch1, total)
    assert stats[1]["samples"] == 2 * N


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(TIMEOUT + 30)
def test_torchrun_two_nodes_each_keeps_its_share(s3_server: Any, slowlink: Any, tmp_path: Path) -> None:
    """``torchrun --nnodes 2 --node-rank 0/1 --nproc-per-node 2`` (static rendezvous on 127.0.0.1),
    each node with its own RAM and SSD directories, through the metering proxy: every epoch is
    exactly once across the 4 ranks; epoch 2 reads <= 1 % of D (each node's cache holds its
    share); each node computed its shard-to-node assignment once, in its own control directory.
    With ``DATACACHE_PEERS=auto`` semantics (``PeerConfig(peers="auto")``): the nodes' peer
    addresses and token come through the job's c10d store, every rank sees both nodes."""
    url, m = _dataset(s3_server)
    link = slowlink(bandwidth=500e6, latency=0.001)
    out = tmp_path / "out"
    out.mkdir()
    cfg = {"url": url, "storage_options": s3_server.storage_options(link.endpoint_url), "nodes": 2,
           "cache_dir": str(tmp_path / "node{node}"), "out_dir": str(out), "epochs": 2, "peers": "auto"}
    port = str(_free_port())
    epoch1, total = _run([["--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", port] for k in (0, 1)], cfg, tmp_path, link)
    _exactly_once(out, 4)
    assert epoch1["bytes_down"] >= m.total_bytes, epoch1
    assert total["bytes_down"] - epoch1["bytes_down"] <= 0.01 * m.total_bytes, (epoch1, total)
    for k in (0, 1):
        assert len(list((tmp_path / f"node{k}").glob("*/control/nodeplan/assign-*.npy"))) == 1
    peers = [json.loads((out / f"rank{r}_stats.json").read_text())["peers"] for r in range(4)]
    assert [(p["enabled"], p["node"], p["nodes"]) for p in peers] == [(True, r // 2, 2) for r in range(4)], peers
    assert peers[0]["refused"] == 0
