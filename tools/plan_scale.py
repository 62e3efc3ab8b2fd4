"""Epoch start at scale: the plan work a consumer does before its first batch, and the node's memory.

For a job of ``--nodes`` nodes x ``--ranks`` ranks x ``--workers`` DataLoader workers, with
``--samples`` samples in shards of ``--per-shard`` samples, it measures with the real plan code what
a consumer does before its first batch: the run's shard-to-node assignment (the dataset computes it
when it is created) and, at the start of an epoch (``StreamingDataset.__iter__``), its own plan and
the node's schedule (every consumer of the node, this epoch and the next, shard level). Both
node-level results are computed once per node and shared through the node cache's control
directory (``datacache.plan.node_share``), so two roles are measured, each in a fresh process:

- the node's *first* consumer, which finds nothing shared and computes and publishes both;
- every *other* consumer of the node, which maps the shared files and plans only for itself.

Figures: ``first_batch_s``: the first consumer's plan wait before its first batch (the others wait
for it at most that long: they read its files); ``other_s``: an other consumer's own work;
``peak_mb``: the peak of memory allocated by the plan work (tracemalloc) of each role;
``shared_mb``: the shared files (in the page cache once per node); ``node_mb``: the node's plan
memory, every consumer at its peak at once: first + (consumers - 1) x other + shared;
``node_cpu_s``: the node's plan CPU time per epoch start.

Usage::

    python tools/plan_scale.py                      # 100 M and 1 B samples at 64 x 8 x 8
    python tools/plan_scale.py --samples 1e7 --json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

TARGETS = {100_000_000: (1.0, 1000.0), 1_000_000_000: (10.0, 4000.0)}  # seconds, MB a node


def _manifest(shards: int, per_shard: int) -> Any:
    from datacache.manifest import Manifest, ShardInfo

    infos = tuple(ShardInfo(f"s{i:07d}.zst", 64 << 20, per_shard, "xxh3:0") for i in range(shards))
    return Manifest(format="zstd", schema={}, shards=infos, dataset_id="ds-scale")


def _epoch_start(manifest: Any, counts: np.ndarray, spec: Any, ranks: list[int], share: str) -> None:
    """What ``StreamingDataset.__iter__`` plans before its first batch."""
    from datacache.plan.epoch import build_plan
    from datacache.read.node_schedule import node_schedule

    build_plan(counts, spec)
    node_schedule(manifest, counts, spec, ranks, share_dir=share)


def run_role(samples: int, per_shard: int, nodes: int, ranks: int, workers: int, share: str,
             traced: bool) -> dict[str, Any]:
    """One consumer's plan work before its first batch, with the node's shared files in ``share``
    (none yet: the first consumer): its wall time, or (``traced``) its peak allocation."""
    import numpy.lib.format as npy_format
    import numpy.ma as npy_ma  # imported by the first np.load
    import numpy.random as npy_random

    from datacache.plan import node_share as _nodeshare
    from datacache.plan.epoch import PlanSpec
    from datacache.plan.node_assign import assign_nodes
    from datacache.read import node_schedule as nodeplan

    shards = -(-samples // per_shard)
    manifest = _manifest(shards, per_shard)
    counts = np.full(shards, per_shard, dtype=np.int64)
    sizes = np.full(shards, 64 << 20, dtype=np.int64)
    counts.flags.writeable = sizes.flags.writeable = False  # as the dataset's
    node = nodes // 2
    node_ranks = list(range(node * ranks, (node + 1) * ranks))
    spec = PlanSpec(seed=1, epoch=3, dp_size=nodes * ranks, dp_rank=node_ranks[0], num_workers=workers,
                    worker_id=workers - 1, num_nodes=nodes, shard_bytes=sizes)
    assert all((nodeplan, _nodeshare, npy_format, npy_ma, npy_random))  # imported before tracing: no plan memory
    if traced:
        tracemalloc.start()
    t0 = time.perf_counter()
    assign_nodes(sizes, nodes, 1, share_dir=share)
    t1 = time.perf_counter()
    _epoch_start(manifest, counts, spec, node_ranks, share)
    t2 = time.perf_counter()
    peak = tracemalloc.get_traced_memory()[1] if traced else 0
    return {"assign_s": t1 - t0, "epoch_s": t2 - t1, "wait_s": t2 - t0, "peak_mb": peak / 1e6}


def _role(share: str, traced: bool, args: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", "--share", share] + (["--traced"] if traced else []) + args
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_case(samples: int, per_shard: int, nodes: int, ranks: int, workers: int) -> dict[str, Any]:
    """Both roles, timed (untraced) and traced, each in a fresh process."""
    args = ["--samples", str(samples), "--per-shard", str(per_shard), "--nodes", str(nodes),
            "--ranks", str(ranks), "--workers", str(workers)]
    got: dict[str, dict[str, Any]] = {}
    for traced in (False, True):
        with tempfile.TemporaryDirectory(prefix="plan-scale-") as share:
            got[f"first{traced}"] = _role(share, traced, args)
            got[f"other{traced}"] = _role(share, traced, args)
            shared = sum(f.stat().st_size for f in Path(share).rglob("*.npy"))
    consumers = ranks * workers
    first, other = got["firstFalse"], got["otherFalse"]
    node_mb = got["firstTrue"]["peak_mb"] + (consumers - 1) * got["otherTrue"]["peak_mb"] + shared / 1e6
    target = TARGETS.get(samples)
    return {"samples": samples, "shards": -(-samples // per_shard), "nodes": nodes, "ranks": ranks,
            "workers": workers, "assign_s": round(first["assign_s"], 3),
            "first_batch_s": round(first["wait_s"], 3), "other_s": round(other["wait_s"], 3),
            "node_cpu_s": round(first["wait_s"] + (consumers - 1) * other["wait_s"], 2),
            "first_peak_mb": round(got["firstTrue"]["peak_mb"], 1),
            "other_peak_mb": round(got["otherTrue"]["peak_mb"], 2),
            "shared_mb": round(shared / 1e6, 1), "node_mb": round(node_mb, 1),
            "target": None if target is None else {"first_batch_s": target[0], "node_mb": target[1]},
            "ok": None if target is None else bool(first["wait_s"] <= target[0] and node_mb <= target[1])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=float, action="append", default=None, help="samples (repeatable)")
    p.add_argument("--per-shard", type=int, default=1000, help="samples per shard (default 1000)")
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--ranks", type=int, default=8, help="ranks per node")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers per rank")
    p.add_argument("--json", action="store_true")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a role in this process
    p.add_argument("--share", help=argparse.SUPPRESS)
    p.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    cases = [int(s) for s in (a.samples or [1e8, 1e9])]
    if a.one:
        print(json.dumps(run_role(cases[0], a.per_shard, a.nodes, a.ranks, a.workers, a.share, a.traced)))
        return 0
    results = [run_case(n, a.per_shard, a.nodes, a.ranks, a.workers) for n in cases]
    if a.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'samples':>14} {'shards':>10} {'job':>10} {'1st batch':>10} {'others':>8} {'node CPU':>9} "
          f"{'1st peak':>9} {'other peak':>10} {'shared':>8} {'node mem':>9}  target")
    for r in results:
        t = r["target"]
        goal = f"<= {t['first_batch_s']} s, {t['node_mb']:.0f} MB a node: {'met' if r['ok'] else 'MISSED'}" if t else ""
        print(f"{r['samples']:>14,} {r['shards']:>10,} {r['nodes']}x{r['ranks']}x{r['workers']:<4} "
              f"{r['first_batch_s']:>9.3f}s {r['other_s']:>7.3f}s {r['node_cpu_s']:>8.1f}s "
              f"{r['first_peak_mb']:>7.1f}MB {r['other_peak_mb']:>8.2f}MB {r['shared_mb']:>6.1f}MB "
              f"{r['node_mb']:>7.1f}MB  {goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
