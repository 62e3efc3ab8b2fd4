"""Smoke test of the benchmark harness (tools/bench.py): datacache only, tiny sizes, a real SeaweedFS
server and slow link, each run in its own process. The peers are not needed (not in the dev extra)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(960)  # a hang guard for a run of ~1 min on an idle machine (was: 170 s)
def test_bench_datacache_tiny(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--systems", "datacache",
           "--variants", "default", "--scenario", "cold,warm,throttle", "--size", "2MB", "--shard-bytes", "256KB",
           "--sample-bytes", "16KiB", "--bandwidth", "1MB", "--latency", "0.002", "--compute", "0.001",
           "--storm", "3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by = {(r["scenario"], r["phase"]): r for r in lines}
    expected = {("cold", "measured"), ("warm", "fill"), ("warm", "measured"), ("throttle", "measured")}
    assert set(by) == expected, by.keys()
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
    # the peer tier: one download per shard per cluster, then max(0, D - N C); global placement without
    # peers goes back to the store for what the node did not read before (2 nodes: half, then capped by C)
    rows = {(p["placement"], p["peers"], p["epoch"]): p for p in two["peers"]}
    assert rows[("node", True, 1)]["store_bytes"] == d and rows[("node", False, 1)]["store_bytes"] > d
    assert rows[("node", True, 2)]["store_bytes"] == d - 2 * 640_000_000 < rows[("node", False, 2)]["store_bytes"]
    assert rows[("global", False, 2)]["store_bytes"] == round(d * max(0.5, 1 - 2 * 640_000_000 / d))
    for p in ("node", "global"):
        assert rows[(p, True, 2)]["gets"] == math.ceil(rows[(p, True, 2)]["store_bytes"] / 8e6) > 0
    assert all(p["store_bytes"] == 0 for p in eight["peers"] if p["peers"] and p["epoch"] > 1)
    assert "max_requests_per_s" in scale_model.advice(20000, 64, 8 << 20, 64 << 20)
    r = plan_scale.run_case(1_000_000, 1000, nodes=8, ranks=2, workers=2)
    assert r["shards"] == 1000 and r["first_batch_s"] > 0 and r["first_peak_mb"] > 0
    consumers = 2 * 2  # node memory: the first consumer's peak, the others' (mapping the shared files), the files
    node = r["first_peak_mb"] + (consumers - 1) * r["other_peak_mb"] + r["shared_mb"]
    assert r["other_peak_mb"] > 0 and r["node_mb"] == pytest.approx(node, abs=0.1 * consumers)  # rounded figures


def test_shuffle_quality_is_one_for_a_random_permutation_and_low_for_sorted_order() -> None:
    """tools/bench_quality: the exact random figure (27.5 classes per batch of 32 on 8,000 samples
    in 100 classes of 80), a seeded random permutation scoring 1.0 against it, and the
    class-sorted order (one shard after the other) scoring what one class per batch scores."""
    import numpy as np

    from tools.bench_quality import BatchQuality, class_of, expected_distinct

    assert class_of([0, 79, 80, 7999], 8000).tolist() == [0, 0, 1, 99]  # id // 80
    assert np.bincount(class_of(np.arange(7629), 7629)).size == 100  # 100 classes at any n
    exact = expected_distinct(8000, 32)
    assert 27.5 < exact < 27.6
    trials = np.random.default_rng(1)  # the same figure by simulation
    sim = np.mean([np.unique(class_of(trials.choice(8000, 32, replace=False), 8000)).size for _ in range(4000)])
    assert abs(sim - exact) < 0.1
    perm, srt = BatchQuality(8000), BatchQuality(8000)
    order = np.random.default_rng(0).permutation(8000)
    for i in range(0, 8000, 32):
        perm.add(order[i:i + 32].tolist())
        srt.add(list(range(i, i + 32)))
    p, s = perm.summary(), srt.summary()
    assert 0.98 <= p["quality"] <= 1.02 and s["quality"] < 0.06
    assert len(p["quality_curve"]) == 20 and all(0.9 <= c <= 1.1 for c in p["quality_curve"])


def _rec(system: str, rep: int, **kw: object) -> dict:
    base = {"system": system, "family": system.split("+")[0], "variant": "default", "scenario": "cold", "rep": rep}
    if "error" in kw:
        return {**base, **kw}
    return {**base, "phase": "measured", "epoch": 0, "D": 1000, "C": None, "n": 10, "bandwidth": 100.0,
            "memcpy_rate": 1e9, "sample_bytes": 100, "run_remote_bytes": 1000, "remote_bytes": 1000,
            "wait": 1.0, "compute": 1.0, "samples": 10, "unique_samples": 10, "first_batch": 0.5,
            "quality": 0.5, **kw}


def test_report_shows_failed_runs_as_failed_with_n_per_cell_never_as_a_win() -> None:
    """A peer none of whose repetitions completed is 'failed' with its cause, and datacache's
    target names no comparison with it (the old report said 'ahead of litdata (aborted)'); a
    failed repetition of a peer that completed others is counted in n; quality is in the table."""
    from tools import bench_report

    records = [_rec("datacache", 0, wall=12.0), _rec("datacache", 1, wall=11.0),
               _rec("litdata", 0, wall=30.0, aborted="stopped after 3 batches: no batch and no byte for 90 s"),
               _rec("litdata", 1, error="exit status 1: ChunkWaitTimeoutError"),
               _rec("streaming", 0, wall=20.0, quality=0.99), _rec("streaming", 1, error="timed out after 600 s")]
    text = bench_report.table(bench_report.medians(records), ["cold"])
    rows = {line.split(" | ")[1]: line for line in text.splitlines()[2:]}
    assert "| 2 | 11.50 |" in rows["datacache"] and "| 0.50 |" in rows["datacache"]
    assert "| 0 of 2 | aborted in epoch 1: stopped after 3 batches" in rows["litdata"]
    assert "| 1 of 2 (failed: failed: timed out after 600 s) | 20.00 |" in rows["streaming"]
    assert "| 0.99 |" in rows["streaming"]
    target = rows["datacache"]
    assert "ahead of litdata" not in target and "no comparison with litdata (litdata failed)" in target
    assert "ahead of streaming (1.74x streaming, quality 0.99)" in target


def test_readme_block_is_replaced_between_its_markers(tmp_path: Path) -> None:
    from tools.bench_text import BEGIN, END, HEADLINE_BEGIN, HEADLINE_END, replace_block, replace_blocks

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold table 1.23\n{END}\noutro\n")
    replace_block(str(readme), f"{BEGIN}\nnew table\n{END}")
    assert readme.read_text() == f"intro\n{BEGIN}\nnew table\n{END}\noutro\n"
    (tmp_path / "bare.md").write_text("no markers\n")
    with pytest.raises(SystemExit, match="no generated benchmark block"):
        replace_block(str(tmp_path / "bare.md"), "x")
    # both pairs in one file, each replaced by its own block; the headline's markers are not the full block's
    readme.write_text(f"a\n{HEADLINE_BEGIN}\nold 1\n{HEADLINE_END}\nb\n{BEGIN}\nold 2\n{END}\nc\n")
    done = replace_blocks(str(readme), {(BEGIN, END): f"{BEGIN}\nfull\n{END}",
                                        (HEADLINE_BEGIN, HEADLINE_END): f"{HEADLINE_BEGIN}\nhead\n{HEADLINE_END}"})
    assert done == [BEGIN, HEADLINE_BEGIN]
    assert readme.read_text() == f"a\n{HEADLINE_BEGIN}\nhead\n{HEADLINE_END}\nb\n{BEGIN}\nfull\n{END}\nc\n"


def test_headline_rows_put_datacache_beside_the_peers_from_the_same_records() -> None:
    """The README's headline table: one row a scenario that ran, datacache beside Streaming and
    LitData through their default settings; a peer whose default failed shows its +tuned figure
    and says so, a peer that failed altogether shows why, never a figure."""
    from tools import bench_report
    from tools.bench_text import HEADLINE_BEGIN, HEADLINE_END, headline_block

    records = [_rec("datacache", 0, wall=12.0), _rec("datacache", 1, wall=11.0),
               _rec("streaming", 0, wall=30.0, aborted="stopped after 3 batches: 9 MB pulled (thrashing)"),
               _rec("streaming+tuned", 0, wall=20.0),
               _rec("litdata", 0, wall=30.0, aborted="stopped after 3 batches: no batch for 90 s (stalled)")]
    rows = bench_report.headline_rows(records)
    assert rows == [("cold epoch: wall (× link bound)", "11.5 s (1.15 ×)",
                     "20.0 s (2.00 ×), +tuned (default thrashed)", "aborted (stalled)")]
    run = {"date": "2026-12-01", "machine": "vm", "versions": {"mosaicml-streaming": "0.13.0", "litdata": "0.2.76"},
           "settings": {"reps": 2, "size": 1000, "sample_bytes": 100, "bandwidth": 100.0, "batch_size": 32,
                        "workers": 2, "compute": 0.02}}
    block = headline_block(run, rows)
    assert block.startswith(HEADLINE_BEGIN) and block.endswith(HEADLINE_END)
    assert "| | datacache | Streaming 0.13.0 | LitData 0.2.76 |" in block and "| 11.5 s (1.15 ×) |" in block


@pytest.mark.timeout(300)
def test_bench_shuffle_scenario_and_readme_regeneration_tiny(tmp_path: Path) -> None:
    """The shuffle scenario (cold, then warm) with datacache's matched-quality variants, every
    record with its quality beside wall and first batch, the same loader settings for every
    variant, and ``--readme``: the raw results published to docs/bench beside the README, its
    headline table and docs/benchmarks.md's block rebuilt; ``bench_report.py docs/bench --readme
    README.md docs/benchmarks.md`` rebuilds the same two."""
    from tools.bench_text import BEGIN, END, HEADLINE_BEGIN, HEADLINE_END

    readme, page = tmp_path / "README.md", tmp_path / "docs" / "benchmarks.md"
    page.parent.mkdir()
    readme.write_text(f"# x\n{HEADLINE_BEGIN}\n{HEADLINE_END}\n")
    page.write_text(f"# y\n{BEGIN}\n{END}\n")
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--systems", "datacache",
           "--scenario", "shuffle,raw", "--variants", "default,matched", "--size", "4MB", "--shard-bytes", "256KB",
           "--sample-bytes", "16KiB", "--bandwidth", "4MB", "--latency", "0.002", "--compute", "0.001",
           "--out", str(out), "--readme", str(tmp_path / "README.md")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=290)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    shuffle = {(r["system"], r["phase"]): r for r in lines if r["scenario"] == "shuffle"}
    systems = {"datacache", "datacache+match-streaming", "datacache+match-litdata"}
    assert set(shuffle) == {(s, p) for s in systems for p in ("cold", "warm")}
    assert {r["system"] for r in lines if r["scenario"] == "raw"} == {"datacache"}  # matched: not in raw
    for r in lines:
        assert r["persistent_workers"] is True and r["workers"] == 2 and r["batch_size"] == 32
        assert 0 < r["quality"] <= 1.2 and r["first_batch"] > 0 and len(r["quality_curve"]) == 20
        assert r["unique_samples"] == r["n"]
    assert shuffle[("datacache", "cold")]["remote_bytes"] > 0 and shuffle[("datacache", "warm")]["remote_bytes"] == 0
    # window 1 mixes less than the default window
    assert shuffle[("datacache+match-litdata", "warm")]["quality"] < shuffle[("datacache", "warm")]["quality"]
    published = tmp_path / "docs" / "bench"
    assert (published / "results.jsonl").read_text() == (out / "results.jsonl").read_text()
    run = json.loads((published / "run.json").read_text())
    assert run["settings"]["batch_size"] == 32 and run["commit"]
    report = (published / "results.md").read_text()
    assert "## shuffle" in report and "| datacache+match-litdata |" in report and "raw: no compute" in report
    block, head = page.read_text(), readme.read_text()
    assert block.startswith(f"# y\n{BEGIN}") and block.rstrip().endswith(END)
    assert "| raw | datacache | 1 |" in block and "Shuffle quality, cold and warm" in block
    assert "[bench/results.jsonl](bench/results.jsonl)" in block  # relative to docs/benchmarks.md
    assert head.startswith(f"# x\n{HEADLINE_BEGIN}") and head.rstrip().endswith(HEADLINE_END)
    assert "| shuffle quality, cold / warm epoch | " in head and "| raw |" not in head
    readme.write_text(f"# x\n{HEADLINE_BEGIN}\n{HEADLINE_END}\n")
    page.write_text(f"# y\n{BEGIN}\n{END}\n")
    regen = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_report.py"), str(published), "--readme",
                            str(readme), str(page)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert regen.returncode == 0, regen.stderr[-3000:]
    assert page.read_text() == block and readme.read_text() == head


def test_mix_counts_per_stream_and_the_rounding_a_peer_may_use() -> None:
    """tools/bench_mix: ids counted per stream (delivered, distinct, most copies); the expected
    counts are the largest-remainder rounding of 0.4/0.3/0.3 x 2441 (977, 732, 732, the quick
    run's), and a peer's other rounding that keeps the sum (Streaming's 976, 732, 733) counts as
    exact while LitData's early stop (662, 522, 488) does not."""
    from tools.bench_mix import StreamCounts, expected, layout, within_one

    assert layout(2441) == [(0, 1221), (1221, 732), (1953, 488)]
    assert expected([1221, 732, 488]) == [977, 732, 732]
    assert within_one([977, 732, 732], 2441) and within_one([976, 732, 733], 2441)
    assert not within_one([662, 522, 488], 2441) and not within_one([975, 733, 733], 2441)
    counts = StreamCounts([0, 5, 8, 10])
    counts.add([0, 1, 1, 9])
    counts.add([8, 9, 9, 4])
    assert counts.summary() == {"stream_samples": [4, 0, 4], "stream_unique": [3, 0, 2],
                                "stream_max_copies": [2, 0, 3]}
