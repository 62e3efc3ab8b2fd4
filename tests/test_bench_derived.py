"""Smoke test of the benchmark's scenarios for issue 40 (tools/bench.py --scenario raw-bytes, limited-bytes,
images; datacache's ``never`` variant): datacache only, tiny sizes, a real SeaweedFS server and slow
link, each run in its own process; and the settings of every derived scenario. No timing assertions:
the figures exist, count the workers' CPU, and reach the report and the README's headline table."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.subprocess
@pytest.mark.timeout(960)  # a hang guard for a run of ~1 min on an idle machine
def test_bench_issue40_scenarios_tiny(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--quick", "--systems", "datacache",
           "--variants", "default,never", "--scenario", "raw,raw-bytes,limited-bytes,raw-shards,images",
           "--size", "2MB", "--images-size", "1MB", "--shard-bytes", "256KB",
           "--sample-bytes", "16KiB", "--bandwidth", "50MB", "--latency", "0.002", "--compute", "0.001",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    runs = {(r["scenario"], r["system"]) for r in lines}
    assert runs == {("raw", "datacache"), ("raw", "datacache+never"), ("raw-bytes", "datacache"),
                    ("raw-bytes", "datacache+never"), ("limited-bytes", "datacache"), ("raw-shards", "datacache"),
                    ("images", "datacache")}, runs
    for r in lines:
        assert "error" not in r and "aborted" not in r, r
        assert r["samples"] == r["n"] == r["unique_samples"], r  # every sample once, every epoch
        # the run's processes, counted in the run's own session: the training process and its 2 workers
        assert r["cpu_scope"] == "session" and r["cpu_procs"] >= 3 and r["cpu_s"] >= r["cpu_main_s"] >= 0, r
    by = {(r["scenario"], r["system"], r["phase"]): r for r in lines if r["phase"] != "measured" or
          r["scenario"] != "limited-bytes"}
    assert all(r["C"] == r["D"] // 2 for r in lines if r["scenario"] == "limited-bytes")
    images = by[("images", "datacache", "measured")]
    assert images["batch_size"] == 64 and images["decode_cpu_s"] > 0
    assert 50_000 < images["sample_bytes"] < 200_000  # the JPEGs' mean size, written by the bench
    assert by[("images", "datacache", "fill")]["cpu_s"] > 0  # the fill epoch decodes too: whole 10 ms ticks

    report = (out / "results.md").read_text()
    assert "| CPU s/GB |" in report and "images/s; loader" in report
    assert "x raw's GB/s (>=0.80)" in report and "x node_shuffle='never' (>=0.90)" in report
    shards = {r["shard_bytes"] for r in lines if r["scenario"] in ("raw", "raw-shards") and r["system"] == "datacache"}
    assert len(shards) == 2, shards  # the raw-shards dataset: the same samples, in 16 times as many shards
    from tools.bench_text import BEGIN, END, HEADLINE_BEGIN, HEADLINE_END

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{HEADLINE_BEGIN}\n{HEADLINE_END}\n{BEGIN}\n{END}\n")
    rebuilt = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_report.py"), str(out), "--readme",
                              str(readme)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stderr[-2000:]
    text = readme.read_text()
    assert "| CPU-seconds per GB delivered, all processes: images |" in text
    assert "| JPEGs decoded and cropped in the workers: images/s (the loader's share of the CPU) |" in text
    assert "CPU s/GB: the CPU-seconds of every process of the run" in text


def test_derived_scenarios_are_their_base_with_one_change() -> None:
    """small-1024, raw-bytes, warm-bytes, limited-bytes, raw-shards: the base scenario's settings but
    the batch or the dataset; images: warm from the cache, no compute, batch 64; never runs beside raw and small."""
    from tools import bench, bench_derived

    a = bench.parse_args(["--out", "x", "--scenario", ",".join(bench_derived.SCENARIOS)])
    sc = {name: bench_derived.scenario(bench.scenario, name, a) for name in bench_derived.SCENARIOS}
    for name, (base, change) in bench_derived.DERIVED.items():
        assert {**bench.scenario(base, a), **change, "name": name, "base": base} == sc[name]
    assert sc["small-1024"]["batch_size"] == 1024 and sc["warm-bytes"]["compute"] == 0.02
    assert sc["limited-bytes"]["phases"] == ["measured"] * 3 and sc["raw-bytes"]["dataset"] == "bytes"
    assert sc["raw-shards"]["dataset"] == "shards" and sc["raw-shards"]["phases"] == ["fill", "measured"]
    assert sc["images"]["phases"] == ["fill", "measured"] and sc["images"]["compute"] == 0.0
    assert sc["images"]["batch_size"] == 64 and sc["images"]["dataset"] == "images"
    assert a.images_size == 200_000_000 and a.image_bytes == 100_000
    assert [s for s in bench.SCENARIOS if bench.runs_in("never", s)] == ["small", "raw", "small-1024", "raw-bytes"]
