"""Smoke tests of the benchmark harness's multi-process scenarios (tools/bench.py --scenario nodes, mix, peers):
datacache only, tiny sizes, a real SeaweedFS server and slow link. A file of their own, so that the suite's
two xdist workers (one test file each at a time) run them beside tests/test_bench.py's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(960)  # a hang guard (was: 230 s)
def test_bench_nodes_scenario_tiny(tmp_path: Path) -> None:
    """The nodes scenario: 4 simulated nodes (one rank process each, its own cache of 0.3 D), 3
    epochs; epochs 2-3 read (almost) nothing, and tools/scale_model predicts every epoch's bytes."""
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--systems", "datacache",
           "--scenario", "nodes", "--nodes", "4", "--size", "4MB", "--shard-bytes", "128KB", "--sample-bytes",
           "16KiB", "--bandwidth", "200MB", "--latency", "0.002", "--compute", "0.001", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [0, 1, 2] and all(r["nodes"] == 4 for r in lines)
    D, predicted = lines[0]["D"], lines[0]["predicted_remote"]
    assert all(r["samples"] >= r["n"] for r in lines), "an epoch lost samples"
    measured = [r["remote_bytes"] for r in lines]
    assert D <= measured[0] <= 1.05 * predicted[0] and predicted[0] >= D
    assert sum(measured[1:]) <= 0.01 * D and predicted[1:] == [0, 0]
    # CPU: every node's session (its rank process and 2 workers) counted once each, summed over the nodes
    assert all(4 * 3 <= r["cpu_procs"] < 8 * 3 and r["cpu_s"] >= r["cpu_main_s"] >= 0 for r in lines)
    assert lines[0]["cpu_s"] > 0
    report = (out / "results.md").read_text()
    assert "| nodes | datacache |" in report
    assert "each node's cold wall / bound" in report  # the per-epoch table, also after a rebuild:
    from tools.bench_text import BEGIN, END

    (tmp_path / "README.md").write_text(f"# x\n{BEGIN}\n{END}\n")
    rebuilt = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_report.py"), str(out), "--readme",
                              str(tmp_path / "README.md")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stderr[-2000:]
    assert "each node's cold wall / bound" in (out / "results.md").read_text()
    assert "**Many nodes, per epoch**" in (tmp_path / "README.md").read_text()


@pytest.mark.timeout(960)  # a hang guard for a run of ~1 min on an idle machine
def test_bench_mix_scenario_and_dropin_variant_tiny(tmp_path: Path) -> None:
    """The mix scenario (issue 15.8) for datacache: three datasets (61, 37, 24 samples) mixed
    0.4/0.3/0.3 of an epoch of 122, a cold epoch then a warm one: every epoch gives each stream
    exactly round(p x 122) samples (49 of 61 distinct; 37 once; 36 from 24, each once or twice),
    the cold epoch's bytes are the drawn samples' (plus at most one shard of the subsampled
    stream), the warm epoch's none; and the warm scenario's dropin variant (torch's DataLoader over
    samples) and torch variant (batched mode through torch's DataLoader) beside the default, every
    sample once from the cache."""
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--systems", "datacache",
           "--variants", "default,dropin,torch", "--scenario", "mix,warm", "--size", "2MB", "--shard-bytes", "128KB",
           "--sample-bytes", "16KiB", "--bandwidth", "4MB", "--latency", "0.002", "--compute", "0.001",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    mix = {r["phase"]: r for r in lines if r["scenario"] == "mix"}
    assert set(mix) == {"cold", "warm"} and all(r["system"] == "datacache" for r in mix.values())
    m = mix["cold"]["mix"]
    assert m["sizes"] == [61, 37, 24] and m["expected"] == [49, 37, 36] and m["epoch_size"] == 122
    for r in mix.values():
        assert r["stream_samples"] == [49, 37, 36] and r["samples"] == 122
        assert r["stream_unique"] == [49, 37, 24] and r["stream_max_copies"] == [1, 1, 2]
    assert m["needed"] <= mix["cold"]["remote_bytes"] <= m["needed"] + 128_000 + 16_384
    assert mix["warm"]["remote_bytes"] == 0
    warm = {r["system"]: r for r in lines if r["scenario"] == "warm" and r["phase"] == "measured"}
    assert set(warm) == {"datacache", "datacache+dropin", "datacache+torch"}
    for r in warm.values():
        assert r["unique_samples"] == r["samples"] == r["n"] and r["batch_size"] == 32
        # no request in the warm epoch. The proxy may tally the fill epoch's last answers a moment
        # late (seen: 1,272 bytes; 50,420 with both cores busy), so bytes are checked over the run
        # (fill and warm epochs in one process): the dataset crossed the link once
        assert r["requests"] == 0, r
        assert r["run_remote_bytes"] <= 1.05 * r["D"] + 16 * 1024, r
    report = (out / "results.md").read_text()
    assert "## mix" in report
    assert "| datacache | 1 | cold | 49/49 · 37/37 · 36/36 | 49 · 37 · 24 | 1 · 1 · 2 |" in report
    assert "datacache's targets: " in report and "every stream's count exact in both epochs" in report
    assert "| warm | datacache+dropin | 1 |" in report and "| warm | datacache+torch | 1 |" in report


@pytest.mark.timeout(960)  # a hang guard for a run of ~30 s on an idle machine
def test_bench_peers_scenario_tiny(tmp_path: Path) -> None:
    """The peers scenario (issue 39.7): 4 simulated nodes, global placement, C = 0.3 D each, every
    node's peer server behind a metering link of its own; datacache with the peer tier configured
    and with nothing configured (nopeers). Every epoch reads every sample exactly once over the
    nodes; the cold epoch takes at least D from the store; the peer links' bytes add up and stay 0
    without a tier; global placement without peers goes back to the store after the first epoch
    (the issue's "before"); with the tier (where this build has one) its bytes cross the peer
    links and each node reports its counters (the tier's targets are tests/test_peers.py's)."""
    import datacache

    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--systems", "datacache",
           "--scenario", "peers", "--nodes", "4", "--size", "4MB",
           "--shard-bytes", "128KB", "--sample-bytes", "16KiB", "--bandwidth", "200MB", "--latency", "0.002",
           "--compute", "0.001", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    runs: dict[str, list[dict]] = {}
    for r in lines:
        runs.setdefault(r["system"], []).append(r)
    assert set(runs) == {"datacache", "datacache+nopeers"}, [r.get("error") for r in lines]
    for system, recs in runs.items():
        assert [r["epoch"] for r in recs] == [0, 1, 2]
        for r in recs:
            assert r["placement"] == "global" and r["nodes"] == 4 and r["C"] == int(0.3 * r["D"])
            assert r["exactly_once"] and r["covered"] == r["n"] and sum(r["rank_samples"]) >= r["n"], (system, r)
            assert len(r["rank_own_walls"]) == 4 and "ids_bits" not in r and "rank_extra" not in r
            assert r["peer_bytes"] == sum(r["peer_link_bytes"]) and len(r["peer_link_bytes"]) == 4
        assert recs[0]["remote_bytes"] >= recs[0]["D"], "the cold epoch read less than D from the store"
        assert [round(c, 2) for c in recs[0]["coverage"]] == [0.25] * 4  # each node a quarter per epoch
        assert all(min(r["coverage"]) > 0.25 for r in recs[1:])  # global: later epochs bring new shards
    nopeers, peers = runs["datacache+nopeers"], runs["datacache"]
    assert all(r["peer_bytes"] == 0 and not r["peer_configured"] for r in nopeers)
    assert sum(r["remote_bytes"] for r in nopeers[1:]) > 0.2 * nopeers[0]["D"]  # the "before"
    assert all(r["peer_configured"] for r in peers)
    if hasattr(datacache, "PeerConfig"):  # the tier is in this build: its bytes cross the metered peer links
        assert all(r["peer_tier"] and len(r["node_peer_stats"]) == 4 for r in peers)
        assert peers[0]["remote_bytes"] + peers[0]["peer_bytes"] >= peers[0]["D"]
        got = sum(s["bytes_from_peers"] for r in peers for s in r["node_peer_stats"])
        assert got > 0 and sum(r["peer_bytes"] for r in peers) > 0
    report = (out / "results.md").read_text()
    assert "## peers" in report and "| datacache+nopeers | 1 | 3 |" in report
    assert "each node's wall / bound (best-worst)" in report and "datacache's targets: " in report
    from tools.bench_text import BEGIN, END

    (tmp_path / "README.md").write_text(f"# x\n{BEGIN}\n{END}\n")
    rebuilt = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_report.py"), str(out), "--readme",
                              str(tmp_path / "README.md")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stderr[-2000:]
    assert "**The cluster as one cache, per epoch**" in (tmp_path / "README.md").read_text()
