"""Smoke test of the benchmark harness (tools/bench.py): datacache only, tiny sizes, a real SeaweedFS
server and slow link, each run in its own process. The peers are not needed (not in the dev extra)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_bench_datacache_tiny(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--systems", "datacache",
           "--scenario", "cold,warm,throttle", "--size", "2MB", "--shard-bytes", "256KB", "--sample-bytes", "16KiB",
           "--bandwidth", "1MB", "--latency", "0.002", "--compute", "0.001", "--storm", "3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by = {(r["scenario"], r["phase"]): r for r in lines}
    assert set(by) == {("cold", "measured"), ("warm", "fill"), ("warm", "measured"), ("throttle", "measured")}, by.keys()
    for r in lines:
        assert r["system"] == "datacache" and r["rep"] == 0
        assert r["samples"] == r["n"] and r["wall"] > 0 and 0 <= r["wait"] <= r["wall"]
    cold, warm = by[("cold", "measured")], by[("warm", "measured")]
    D = cold["D"]
    assert D <= cold["run_remote_bytes"] <= 1.05 * D  # metered at the proxy: the dataset crossed once
    assert by[("warm", "fill")]["remote_bytes"] >= D
    assert warm["remote_bytes"] == 0  # served from the cache
    storm = by[("throttle", "measured")]  # a 3 s storm from D/2 on: survived, every sample once
    assert storm["throttled_requests"] > 0 and storm["unique_samples"] == storm["n"] and storm["storm"] == 3

    table = (out / "results.md").read_text()
    assert "| cold | datacache |" in table and "| warm | datacache |" in table
    assert "throttled requests, exactly once" in table
    assert "| cold | datacache |" in proc.stdout  # the table is printed too
    assert (out / "bench_wall.png").stat().st_size > 0


@pytest.mark.timeout(240)
def test_bench_nodes_scenario_tiny(tmp_path: Path) -> None:
    """The nodes scenario: 4 simulated nodes (one rank process each, its own cache of 0.3 D), 3
    epochs; epochs 2-3 read (almost) nothing, and tools/scale_model predicts every epoch's bytes."""
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--systems", "datacache",
           "--scenario", "nodes", "--nodes", "4", "--size", "4MB", "--shard-bytes", "128KB", "--sample-bytes",
           "16KiB", "--bandwidth", "200MB", "--latency", "0.002", "--compute", "0.001", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [0, 1, 2] and all(r["nodes"] == 4 for r in lines)
    D, predicted = lines[0]["D"], lines[0]["predicted_remote"]
    assert all(r["samples"] >= r["n"] for r in lines), "an epoch lost samples"
    measured = [r["remote_bytes"] for r in lines]
    assert D <= measured[0] <= 1.05 * predicted[0] and predicted[0] >= D
    assert sum(measured[1:]) <= 0.01 * D and predicted[1:] == [0, 0]
    assert "| nodes | datacache |" in (out / "results.md").read_text()


def test_scale_model_and_plan_scale_small(capsys: pytest.CaptureFixture[str]) -> None:
    """tools/scale_model.py and tools/plan_scale.py on small cases, computed from the real plan:
    the first epoch reads D, later ones each node's share beyond its cache, GET rates follow the
    per-node bandwidth, and the advice appears when over S3's per-prefix rate."""
    from tools import plan_scale, scale_model

    assert scale_model.main(["--nodes", "2,8", "--dataset", "2GB", "--shard", "64MB", "--cache", "640MB",
                             "--bandwidth", "1GB", "--part", "8MB", "--epochs", "2", "--json"]) == 0
    two, eight = json.loads(capsys.readouterr().out)
    d = (2_000_000_000 // 64_000_000) * 64_000_000
    for r in (two, eight):
        assert r["epochs"][0]["remote_bytes"] >= d and r["epochs"][0]["gets"] == r["epochs"][0]["remote_bytes"] // 8e6
        assert r["epochs"][0]["gets_per_s_peak"] <= r["nodes"] * 1e9 / 8e6 + 1
    # 31 shards: 16 and 15, and one they share
    assert two["epochs"][1]["remote_bytes"] == 2 * (two["share_bytes"]["max"] - 640_000_000)
    assert eight["epochs"][1]["remote_bytes"] == 0 and eight["epochs"][1]["gets_per_s_peak"] == 0
    assert "within one prefix" in two["advice"]
    assert "max_requests_per_s" in scale_model.advice(20000, 64, 8 << 20, 64 << 20)
    r = plan_scale.run_case(1_000_000, 1000, nodes=8, ranks=2, workers=2)
    assert r["shards"] == 1000 and r["first_batch_s"] > 0 and r["peak_mb"] > 0
