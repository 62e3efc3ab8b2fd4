"""Epoch start at scale: the plan work a consumer does before its first batch, and its memory.

For a job of ``--nodes`` nodes x ``--ranks`` ranks x ``--workers`` DataLoader workers, with
``--samples`` samples in shards of ``--per-shard`` samples, it measures with the real plan code:

- ``assign_s``: the run's shard-to-node assignment (once per process tree: the dataset computes it
  when it is created, and forked DataLoader workers inherit it);
- ``first_batch_s``: what one consumer does at the start of an epoch (``StreamingDataset.__iter__``):
  its own plan, and the node's schedule (every consumer of the node, this epoch and the next,
  shard level), told to the cache as a ``Schedule``;
- ``node_cpu_s``: that times the node's consumers (each consumer process plans for itself);
- ``peak_mb``: the peak of memory allocated by the plan work (tracemalloc), assignment included.

Each case runs in a fresh process. Usage::

    python tools/plan_scale.py                      # 100 M and 1 B samples at 64 x 8 x 8
    python tools/plan_scale.py --samples 1e7 --json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

TARGETS = {100_000_000: (1.0, 1000.0), 1_000_000_000: (10.0, 4000.0)}  # seconds, MB


def _manifest(shards: int, per_shard: int) -> Any:
    from datacache.manifest import Manifest, ShardInfo

    infos = tuple(ShardInfo(f"s{i:07d}.zst", 64 << 20, per_shard, "xxh3:0") for i in range(shards))
    return Manifest(format="zstd", schema={}, shards=infos, dataset_id="ds-scale")


def _epoch_start(manifest: Any, counts: np.ndarray, spec: Any, ranks: list[int]) -> None:
    """What ``StreamingDataset.__iter__`` plans before its first batch."""
    from datacache.nodeplan import node_schedule
    from datacache.plan import build_plan

    build_plan(counts, spec)
    node_schedule(manifest, counts, spec, ranks)


def run_case(samples: int, per_shard: int, nodes: int, ranks: int, workers: int) -> dict[str, Any]:
    from datacache._nodeorder import assign_nodes
    from datacache.plan import PlanSpec

    shards = -(-samples // per_shard)
    manifest = _manifest(shards, per_shard)
    counts = np.full(shards, per_shard, dtype=np.int64)
    sizes = np.full(shards, 64 << 20, dtype=np.int64)
    counts.flags.writeable = sizes.flags.writeable = False  # as the dataset's
    dp = nodes * ranks
    node = nodes // 2
    node_ranks = list(range(node * ranks, (node + 1) * ranks))
    spec = PlanSpec(seed=1, epoch=3, dp_size=dp, dp_rank=node_ranks[0], num_workers=workers, worker_id=workers - 1,
                    num_nodes=nodes, shard_bytes=sizes)
    tracemalloc.start()
    t0 = time.perf_counter()
    assign_nodes(sizes, nodes, 1)
    t1 = time.perf_counter()
    _epoch_start(manifest, counts, spec, node_ranks)
    t2 = time.perf_counter()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # untraced timing (tracemalloc slows allocation), next epoch, same process: the assignment is kept
    t3 = time.perf_counter()
    _epoch_start(manifest, counts, spec.__class__(**{**spec.__dict__, "epoch": 4}), node_ranks)
    first = time.perf_counter() - t3
    target = TARGETS.get(samples)
    return {"samples": samples, "shards": shards, "nodes": nodes, "ranks": ranks, "workers": workers,
            "assign_s": round(t1 - t0, 3), "first_batch_s": round(first, 3),
            "first_batch_traced_s": round(t2 - t1, 3), "node_cpu_s": round(first * ranks * workers, 2),
            "peak_mb": round(peak / 1e6, 1),
            "target": None if target is None else {"first_batch_s": target[0], "peak_mb": target[1]},
            "ok": None if target is None else bool(first <= target[0] and peak / 1e6 <= target[1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=float, action="append", default=None, help="samples (repeatable)")
    p.add_argument("--per-shard", type=int, default=1000, help="samples per shard (default 1000)")
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--ranks", type=int, default=8, help="ranks per node")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers per rank")
    p.add_argument("--json", action="store_true")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a case in this process
    a = p.parse_args(argv)
    cases = [int(s) for s in (a.samples or [1e8, 1e9])]
    if a.one:
        print(json.dumps(run_case(cases[0], a.per_shard, a.nodes, a.ranks, a.workers)))
        return 0
    results = []
    for n in cases:
        cmd = [sys.executable, __file__, "--one", "--samples", str(n), "--per-shard", str(a.per_shard),
               "--nodes", str(a.nodes), "--ranks", str(a.ranks), "--workers", str(a.workers)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if a.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'samples':>14} {'shards':>10} {'job':>10} {'assign':>8} {'1st batch':>10} {'node CPU':>9} "
          f"{'peak':>9}  target")
    for r in results:
        t = r["target"]
        goal = f"<= {t['first_batch_s']} s, {t['peak_mb']:.0f} MB: {'met' if r['ok'] else 'MISSED'}" if t else ""
        print(f"{r['samples']:>14,} {r['shards']:>10,} {r['nodes']}x{r['ranks']}x{r['workers']:<4} "
              f"{r['assign_s']:>7.2f}s {r['first_batch_s']:>9.3f}s {r['node_cpu_s']:>8.1f}s "
              f"{r['peak_mb']:>7.1f}MB  {goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
