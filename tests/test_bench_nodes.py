"""The simulated nodes of the benchmark's nodes scenario (tools/bench_nodes.py): each node process
has its own /dev/shm and temp directory, as a separate host has, and the report puts every
system's per-epoch figures side by side (or says why a system did not run)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tools import bench_nodes

# Each node writes a marker into /dev/shm and its TMPDIR, then lists what it sees there.
_PROBE = ("import os, sys; k = os.environ['BENCH_NODE']; "
          "open(f'/dev/shm/dcbench-probe-{k}', 'w').close(); "
          "open(os.path.join(os.environ['TMPDIR'], 'p'), 'w').close(); "
          "print(k, os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['NNODES'], os.environ['TMPDIR'], "
          "sorted(f for f in os.listdir('/dev/shm') if f.startswith('dcbench-probe-')))")


@pytest.mark.timeout(60)
def test_simulated_nodes_do_not_share_dev_shm(tmp_path: Path) -> None:
    wrap, why = bench_nodes.isolation()
    if wrap is None:
        pytest.skip(f"no mount namespace here ({why}); the bench then reports Streaming unavailable")
    seen = []
    for argv, env in bench_nodes.node_processes([sys.executable, "-c", _PROBE], 2, 12345, str(tmp_path / "run")):
        out = subprocess.run(argv, env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=50)
        assert out.returncode == 0, out.stderr
        seen.append(out.stdout.strip().split(maxsplit=5))
    assert [s[:4] for s in seen] == [["0", "0", "2", "2"], ["1", "1", "2", "2"]]
    assert seen[0][4] != seen[1][4]  # a temp directory per node (Streaming's file locks)
    assert seen[0][5] == "['dcbench-probe-0']" and seen[1][5] == "['dcbench-probe-1']"  # node 1 does not see node 0's
    assert not list(Path("/dev/shm").glob("dcbench-probe-*"))  # nor does the host
    assert bench_nodes.unavailable("streaming") is None
    assert bench_nodes.loader_kwargs("streaming", {"nodes": 4}) == {"num_canonical_nodes": 4}


def _epoch(system: str, e: int, remote: float, wall: float) -> dict:
    return {"scenario": "nodes", "system": system, "rep": 0, "epoch": e, "nodes": 4, "wall": wall,
            "own_wall": wall, "remote_bytes": remote, "bandwidth": 50e6, "rank_own_walls": [wall - 1, wall],
            "link_timeline": [(0.25, 0), (0.5, 1e6)]}


def test_nodes_report_side_by_side_and_why_not() -> None:
    recs = [_epoch("datacache", e, b, w) for e, (b, w) in enumerate([(500e6, 11.0), (0, 1.5), (0, 1.4)])]
    recs += [{"scenario": "nodes", "system": "streaming", "rep": 0, "unavailable": "several Streaming nodes x"}]
    text = bench_nodes.report(recs)
    assert "| datacache | 500.0 / 0.0 / 0.0 | 11.0 / 1.5 / 1.4 | 10.00 | 1.00-1.10 | 0.50 |" in text
    assert "| streaming | several Streaming nodes x |" in text
    assert bench_nodes.report([{**recs[0], "scenario": "cold"}]) == ""


@pytest.mark.timeout(60)
def test_each_node_writes_its_own_profile_and_they_are_joined(tmp_path: Path) -> None:
    """``--profile nodes``: a profiler's ``-o FILE`` becomes one file per node, joined after the run."""
    out = tmp_path / "profile.pyspy.txt"
    write = ("import os, sys; "
             "open(sys.argv[sys.argv.index('-o') + 1], 'w').write(f\"stack;{os.environ['BENCH_NODE']} 3\\n\")")
    argv = [sys.executable, "-c", write, "-o", str(out)]
    for cmd, env in bench_nodes.node_processes(argv, 2, 12345, str(tmp_path / "run")):
        subprocess.run(cmd, env={"PATH": "/usr/bin:/bin", **env}, check=True, timeout=50)
    bench_nodes.merge_outputs(argv, 2)
    assert out.read_text() == "stack;0 3\nstack;1 3\n" and not list(tmp_path.glob("profile.pyspy.txt.node*"))


def _node_epoch(system: str, scenario: str, e: int, ids: list[list[int]], stats: list | None = None) -> dict:
    from tools import bench_peers

    n = 8
    return {"scenario": scenario, "system": system, "rep": 0, "epoch": e, "phase": "measured", "n": n, "D": 800,
            "C": 240, "nodes": len(ids), "batch_size": 2, "wall": 1.0, "own_wall": 1.0, "samples": 4,
            "rank_samples": [len(x) for x in ids], "remote_bytes": 100 * (e == 0), "quality": 0.5 + 0.1 * e,
            "rank_extra": [{"ids_bits": bench_peers.ids_bits([np.array(x)], n),
                            **({"peer_stats": s} if s else {})} for x, s in zip(ids, stats or [None] * len(ids))]}


def test_peers_finish_joins_the_nodes_ids_and_peer_counters_and_the_placement_table_compares() -> None:
    """tools/bench_peers.finish: exactly once over the nodes from each node's id bitmap (a sample
    no node read, or read by two, is caught), each node's coverage so far, the peer counters per
    epoch from the cumulative ones; placement_table puts node-sticky beside global per epoch."""
    from tools import bench, bench_peers

    sticky = bench_peers.finish([_node_epoch("datacache+node-sticky", "shuffle", e, [[0, 1, 2, 3], [4, 5, 6, 7]])
                                 for e in range(2)])
    assert [r["exactly_once"] for r in sticky] == [True, True] and sticky[1]["coverage"] == [0.5, 0.5]
    assert all("rank_extra" not in r and "ids_bits" not in r for r in sticky)
    spread = bench_peers.finish([_node_epoch("datacache+global", "shuffle", 0, [[0, 1, 2, 3], [4, 5, 6, 7]],
                                             [{"bytes_from_peers": 10}, {"bytes_from_peers": 0}]),
                                 _node_epoch("datacache+global", "shuffle", 1, [[4, 5, 0, 1], [2, 3, 6, 7]],
                                             [{"bytes_from_peers": 30}, {"bytes_from_peers": 5}])])
    assert spread[1]["coverage"] == [0.75, 0.75] and spread[1]["peer_tier"]
    assert [s["bytes_from_peers"] for s in spread[1]["node_peer_stats"]] == [20, 5]
    lost = bench_peers.finish([_node_epoch("datacache", "peers", 0, [[0, 1, 2, 3], [3, 4, 5, 6]])])
    assert lost[0]["covered"] == 7 and not lost[0]["exactly_once"]  # 7 never read, 3 twice
    table = bench_peers.placement_table(sticky + spread)
    assert "| node-sticky (default) | datacache+node-sticky (shuffle) | 1 | 2 | 0.50 / 0.60 | 0.50 / 0.50 |" in table
    assert "| global | datacache+global (shuffle) | 1 | 2 | 0.50 / 0.60 | 0.50 / 0.75 |" in table
    assert bench_peers.placement_table([]) == ""
    assert bench.runs_in("node-sticky", "shuffle") and not bench.runs_in("global", "cold")
    assert bench.runs_in("nopeers", "peers") and not bench.runs_in("nopeers", "nodes")
    assert not bench.runs_in("tuned", "peers") and bench.runs_in("default", "peers")
    sc = bench_peers.placement_variant({"name": "shuffle"}, "global", 4)
    assert sc == {"name": "shuffle", "nodes": 4, "placement": "global"}
    assert bench_peers.dataset_kwargs({"scenario": sc}) == {"placement": "global"}
