"""One training job for tests/test_shared_cache.py, run as its own process: read one dataset for
some epochs through a node cache whose directories other jobs share.

Usage: ``python tests/helpers/shared_cache_job.py URL RAM_DIR SSD_DIR RAM_BYTES EPOCHS STORAGE_OPTIONS_REPR``.
Lock-step with the test: before each epoch the job prints ``ready`` and waits for a line on stdin
(so the jobs' epochs overlap and the test can count each epoch's bytes); after the last epoch it
prints ``done`` and exits 0. Every epoch must read every sample exactly once. Each sample costs
2 ms of simulated training step, so that the two jobs move through their epochs at the pace of
their steps, as training jobs do, and not at whatever share of a busy machine's CPU each gets
(the node policy compares the datasets' next uses on their own epoch clocks).
"""
from __future__ import annotations

import ast
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from datacache import CacheConfig, NodeCache, StreamingDataset


def main(url: str, ram_dir: str, ssd_dir: str, ram_bytes: str, epochs: str, opts: str) -> int:
    cfg = CacheConfig(ram_bytes=int(ram_bytes), ssd_bytes=0, ram_dir=ram_dir, ssd_dir=ssd_dir)
    with NodeCache(cfg) as cache:
        ds = StreamingDataset(url, storage_options=ast.literal_eval(opts), cache=cache)
        for epoch in range(int(epochs)):
            print("ready", flush=True)
            if not sys.stdin.readline():
                return 1  # the test is gone
            ds.set_epoch(epoch)
            ids = sorted(int(s["i"]) for s in _paced(ds))
            assert ids == list(range(len(ids))) and ids, f"epoch {epoch}: not every sample exactly once"
        ds.source.close()
    print("done", flush=True)
    return 0


def _paced(samples: Iterable[dict[str, Any]], step: float = 0.002) -> Iterator[dict[str, Any]]:
    """The samples, one simulated training step (``step`` seconds of sleep) after each."""
    for s in samples:
        yield s
        time.sleep(step)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
