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
