"""A real ``torchrun --standalone --nproc_per_node=2`` job (gloo) over the S3 fixture, reached
through a metering SlowLink proxy, both ranks sharing one node cache: samples are split exactly once
across ranks, each shard crosses the link once for the node in epoch 1, and epoch 2 costs nothing."""
from __future__ import annotations

import json
import os
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


@pytest.mark.timeout(TIMEOUT + 30)
def test_torchrun_two_ranks_share_node_cache(s3_server: Any, slowlink: Any, tmp_path: Path) -> None:
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/"
    # written straight to the server: the link sees only the job's reads
    rng = np.random.default_rng(0)  # incompressible payload: ~48 KB shards
    m = write_dataset(({"i": i, "x": rng.integers(0, 2**31 - 1, 64, dtype=np.int32)} for i in range(N)), url,
                      shard_bytes=48 << 10, storage_options=s3_server.storage_options(), progress=False)
    shard_bytes = m.total_bytes
    assert len(m.shards) >= 8
    manifest_bytes = len(m.to_json().encode())
    link = slowlink(bandwidth=500e6, latency=0.001)

    out, cache_dir = tmp_path / "out", tmp_path / "cache"
    out.mkdir()
    cfg = {"url": url, "storage_options": s3_server.storage_options(link.endpoint_url), "cache_dir": str(cache_dir),
           "out_dir": str(out), "epochs": 2}
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    log = tmp_path / "torchrun.log"
    deadline = time.monotonic() + TIMEOUT
    with open(log, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 str(WORKER), str(cfg_path)], cwd=ROOT, env=env, stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while not (out / "epoch0.done").exists():
                assert proc.poll() is None, f"torchrun exited early ({proc.returncode}):\n{_log_tail(log)}"
                assert time.monotonic() < deadline, f"epoch 1 did not finish:\n{_log_tail(log)}"
                time.sleep(0.05)
            epoch1 = link.snapshot()
            (out / "epoch0.go").touch()
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)  # the job's own process group: torchrun and its ranks
                proc.wait()
            raise
    assert rc == 0, f"torchrun failed ({rc}):\n{_log_tail(log)}"
    total = link.snapshot()

    # exactly once across ranks, every epoch; equal shares; epochs differ
    orders = []
    for epoch in range(2):
        per_rank = [json.loads((out / f"rank{r}_epoch{epoch}.json").read_text()) for r in range(2)]
        assert len(per_rank[0]) == len(per_rank[1]) == N // 2
        assert not set(per_rank[0]) & set(per_rank[1]), f"epoch {epoch}: ranks share samples"
        assert sorted(per_rank[0] + per_rank[1]) == list(range(N)), f"epoch {epoch}: not every sample once"
        orders.append(per_rank[0])
    assert orders[0] != orders[1]

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
