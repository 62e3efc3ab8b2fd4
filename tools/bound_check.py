"""Remote bytes per epoch for a reshuffled once-per-epoch read with C = D/2, LRU vs clairvoyant.

Writes a local dataset (``file://``), then for each policy reads it for ``--epochs`` epochs through
``StreamingDataset`` with a RAM-only cache of ``--fraction`` x D bytes and reports the remote bytes
(bytes fetched from the store, counted by the cache) per epoch next to the bound D - C.

    python tools/bound_check.py [--shards 64] [--shard-bytes 1MB] [--fraction 0.5] [--epochs 3] [--workers 0]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import datacache  # noqa: E402
from datacache.config import parse_size  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--shard-bytes", default="1MB")
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=0)
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="datacache-bound-")
    try:
        shard_bytes = parse_size(args.shard_bytes)
        per = 16
        sample = shard_bytes // per
        rng = np.random.default_rng(0)
        samples = ({"x": rng.integers(0, 256, sample - 64, dtype=np.uint8), "i": i} for i in range(args.shards * per))
        url = "file://" + os.path.join(tmp, "ds")
        m = datacache.write_dataset(samples, url, shard_bytes=shard_bytes - 1, progress=False)
        D = m.total_bytes
        C = int(D * args.fraction)
        print(f"D = {D / 1e6:.1f} MB in {len(m.shards)} shards, C = {C / 1e6:.1f} MB, "
              f"bound D - C = {(D - C) / 1e6:.1f} MB")
        print("| policy | " + " | ".join(f"epoch {e + 1} remote MB" for e in range(args.epochs))
              + " | epochs 2+ / (D - C) |")
        print("|---|" + "---|" * (args.epochs + 1))
        for policy in ("lru", "clairvoyant"):
            cfg = datacache.CacheConfig(ram_bytes=C, ssd_bytes=0, ram_dir=os.path.join(tmp, policy, "ram"),
                                        ssd_dir=os.path.join(tmp, policy, "ssd"), policy=policy)
            ds = datacache.StreamingDataset(url, cache=cfg, seed=1, shuffle=True)
            loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.workers)
            per_epoch = []
            for e in range(args.epochs):
                ds.set_epoch(e)
                before = ds.cache.stats()["remote_bytes"]
                n = sum(1 for _ in loader)
                assert n == m.num_samples, (n, m.num_samples)
                per_epoch.append(ds.cache.stats()["remote_bytes"] - before)
            later = sum(per_epoch[1:]) / max(len(per_epoch) - 1, 1)
            print(f"| {policy} | " + " | ".join(f"{b / 1e6:.1f}" for b in per_epoch) + f" | {later / (D - C):.3f} |")
            ds.close()
            ds.cache.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
