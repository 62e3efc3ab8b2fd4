"""PyTorch's own cost of handing a batch from a DataLoader worker to the training loop.

    python tools/loader_floor.py [--workers 2] [--batches 240] [--step 0.02] [--reps 3] [--no-range]

A dataset that yields a constant one-field dict (no data, no decoding) behind
``DataLoader(batch_size=None, num_workers=W, persistent_workers=True)``; the training loop sleeps
``--step`` seconds per batch, like the benchmarks' simulated compute. Prints the time spent in
``next()`` per batch (median, p90) and as a share of the epoch: the consumer wait that any
dataset pays on this machine before a byte of data moves (the ``warm`` scenario's floor).
``--no-range`` takes the batches as ``datacache.DataLoader`` does, without the profiler range
torch's iterator opens around each one (``datacache.pytorch.loader.batch_step``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Iterator

import torch.utils.data as tud

try:
    from datacache.pytorch.torch_compat import batch_step
except ModuleNotFoundError:  # run from the checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from datacache.pytorch.torch_compat import batch_step


class _Constant(tud.IterableDataset):
    def __init__(self, batches: int) -> None:
        super().__init__()
        self.batches = batches

    def __iter__(self) -> Iterator[dict[str, int]]:
        info = tud.get_worker_info()
        workers, wid = (info.num_workers, info.id) if info else (1, 0)
        for i in range(wid, self.batches, workers):
            yield {"id": i}


def measure(loader: Any, step: float, no_range: bool = False) -> tuple[list[float], float]:
    """(seconds in each next() after the first, epoch wall) for one epoch."""
    waits, t0 = [], time.perf_counter()
    it = iter(loader)
    take = batch_step(it) if no_range else it.__next__
    take()
    while True:
        time.sleep(step)
        ta = time.perf_counter()
        try:
            take()
        except StopIteration:
            break
        waits.append(time.perf_counter() - ta)
    return waits, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batches", type=int, default=240)
    p.add_argument("--step", type=float, default=0.02, help="seconds of simulated compute per batch")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-range", action="store_true",
                   help="skip torch's per-batch profiler range, as datacache.DataLoader")
    a = p.parse_args(argv)
    loader = tud.DataLoader(_Constant(a.batches), batch_size=None, num_workers=a.workers,
                            persistent_workers=a.workers > 0)
    for rep in range(a.reps):
        waits, wall = measure(loader, a.step, a.no_range)
        ms = sorted(w * 1e3 for w in waits)
        print(f"rep {rep}: next() median {statistics.median(ms):.3f} ms, p90 {ms[int(0.9 * len(ms))]:.3f} ms, "
              f"{100 * sum(waits) / wall:.1f} % of a {wall:.2f} s epoch ({len(ms)} batches, {a.workers} workers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
