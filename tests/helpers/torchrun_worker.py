"""One rank of tests/test_torchrun.py, started by ``torchrun --standalone --nproc_per_node=2`` or,
one node of several, ``torchrun --nnodes N --node-rank K``.

Reads a JSON config (argv[1]): url, storage_options, cache_dir (``{node}`` in it: the node's rank),
out_dir, epochs, nodes (default 1), peers (``PeerConfig.peers``, e.g. "auto": addresses and token
exchanged through the job's c10d store). Every rank streams each epoch through a 2-worker DataLoader over
its node's cache (shared by the node's ranks), and writes the sample ids it got to
``out_dir/rank{r}_epoch{e}.json``. Between epochs rank 0 writes
``epoch{e}.done`` and waits for the test to answer ``epoch{e}.go`` (so the test can read the proxy's
counters at that point); the ranks meet at barriers around that handshake.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist
from torch.utils.data import DataLoader

from datacache import CacheConfig, PeerConfig, StreamingDataset
from datacache.dist import detect


def main() -> int:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = world // cfg.get("nodes", 1)
    info = detect()
    assert (info.rank, info.world_size, info.local_world_size) == (rank, world, per_node), info
    out = cfg["out_dir"]
    node_dir = cfg["cache_dir"].format(node=rank // per_node)
    cache = CacheConfig(ram_bytes="64MB", ssd_bytes="64MB", ram_dir=os.path.join(node_dir, "ram"),
                        ssd_dir=os.path.join(node_dir, "ssd"))
    ds = StreamingDataset(cfg["url"], storage_options=cfg["storage_options"], cache=cache, seed=5,
                          node_shuffle=cfg.get("node_shuffle", "auto"),
                          peers=PeerConfig(peers=cfg["peers"]) if cfg.get("peers") else None)
    assert (ds.dp_rank, ds.dp_size, ds.num_nodes) == (rank, world, cfg.get("nodes", 1))
    loader = DataLoader(ds, batch_size=16, num_workers=2)
    for epoch in range(cfg["epochs"]):
        ds.set_epoch(epoch)
        ids = [i for batch in loader for i in batch["i"].tolist()]
        with open(os.path.join(out, f"rank{rank}_epoch{epoch}.json"), "w") as f:
            json.dump(ids, f)
        dist.barrier()
        if epoch + 1 < cfg["epochs"]:
            if rank == 0:
                open(os.path.join(out, f"epoch{epoch}.done"), "w").close()
                go = os.path.join(out, f"epoch{epoch}.go")
                deadline = time.monotonic() + 120
                while not os.path.exists(go):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no {go} from the test")
                    time.sleep(0.05)
            dist.barrier()
    stats = ds.stats()
    with open(os.path.join(out, f"rank{rank}_stats.json"), "w") as f:
        json.dump({**{k: v for k, v in stats.items() if isinstance(v, (int, float))}, "peers": stats["peers"]}, f)
    ds.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
