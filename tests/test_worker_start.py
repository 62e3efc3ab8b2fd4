"""A DataLoader worker's epoch start does no import work: everything its plan needs is imported
with ``datacache`` in the training process, which the forked workers inherit (an import in each
worker costs CPU at the very moment all of a node's workers start, before their first request)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PLAN = """
import sys
import numpy as np
import datacache.pytorch.dataset
from datacache.plan.epoch import PlanSpec, build_plan
before = set(sys.modules)
counts = np.full(64, 100, dtype=np.int64)
sizes = np.full(64, 1000, dtype=np.int64)
for placement, nodes in (("node", 4), ("global", 1)):
    spec = PlanSpec(seed=0, epoch=1, dp_size=4, dp_rank=1, num_workers=2, worker_id=1, batch_size=8,
                    num_nodes=nodes, placement=placement, shard_bytes=sizes)
    assert len(build_plan(counts, spec)) > 0
print(sorted(set(sys.modules) - before))
"""


def test_epoch_plan_imports_nothing_new() -> None:
    out = subprocess.run([sys.executable, "-c", _PLAN], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"imported at the first plan (in every DataLoader worker): {out.stdout}"
