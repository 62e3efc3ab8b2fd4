"""``make demo``'s table (issue 37.17): the same CNN's step took 34.3 s in the cold epoch's loop
and 10.0 s in the warm one's (the pipeline shared the CPUs), so "compute bound = sum of step
times" made a 36.7 s cold epoch read "1.07 x bound" beside a 10.4 s warm one. The compute bound is
now the step alone, the same measure for both epochs, with the walls side by side."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tools.demo import report

ROOT = Path(__file__).resolve().parents[1]


def _rows(text: str) -> dict[str, dict[str, str]]:
    """The table's rows by epoch name ("1 (cold)"), each by column header."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]
    return {r["epoch"]: r for r in rows}


def _epoch(epoch: int, wall: float, in_loop: float, remote: int, step_alone: float,
           batches: int = 100) -> dict[str, Any]:
    return {"epoch": epoch, "wall": wall, "wait": wall - in_loop, "compute": in_loop, "samples": 32 * batches,
            "batches": batches, "remote_bytes": remote, "step_alone": step_alone, "compute_bound": step_alone * batches}


def test_report_does_not_hide_a_slower_cold_epoch() -> None:
    """The issue's figures: the cold row must read about 3.7 x its bounds, not 1.07."""
    results = [_epoch(0, 36.7, 34.3, 500_000_000, 0.1), _epoch(1, 10.4, 10.0, 0, 0.1)]
    text = report(results, 500_000_000, 50e6)
    rows = _rows(text)
    cold, warm = rows["1 (cold)"], rows["2 (warm)"]
    assert float(cold["wall / max(bounds)"]) == pytest.approx(36.7 / 10.0, abs=0.01), text
    assert float(warm["wall / max(bounds)"]) == pytest.approx(1.04, abs=0.01), text
    assert cold["step time in loop s"] == "34.3" and warm["step time in loop s"] == "10.0", text
    assert cold["compute bound s (step alone)"] == warm["compute bound s (step alone)"] == "10.0", text
    assert "wall time side by side: cold 36.7 s, warm 10.4 s (cold 3.5x the warm)" in text, text


@pytest.mark.timeout(180)
def test_demo_prints_both_epochs_against_one_compute_bound(tmp_path: Path) -> None:
    """The demo itself, small: its table and demo.json hold one compute bound per batch for both epochs."""
    out = tmp_path / "demo-out"
    cmd = [sys.executable, str(ROOT / "tools" / "demo.py"), "--out", str(out), "--size", "3MB",
           "--sample-bytes", "16KiB", "--shard-bytes", "1MB", "--bandwidth", "20MB", "--latency", "0",
           "--ram-bytes", "64MB"]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                       timeout=170)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = _rows(r.stdout)
    assert list(rows) == ["1 (cold)", "2 (warm)"], r.stdout
    assert rows["1 (cold)"]["compute bound s (step alone)"] == rows["2 (warm)"]["compute bound s (step alone)"]
    assert "wall time side by side: cold " in r.stdout and "the same measure for every epoch" in r.stdout
    results = json.loads((out / "demo.json").read_text())["results"]
    assert results[0]["batches"] == results[1]["batches"] > 0
    assert results[0]["compute_bound"] == results[1]["compute_bound"] == pytest.approx(
        results[0]["step_alone"] * results[0]["batches"])
    assert results[0]["remote_bytes"] > 0 == results[1]["remote_bytes"]
