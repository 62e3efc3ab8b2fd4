"""One rank of one "node" in tests/test_multinode.py and tests/test_peers_nodes.py: a process started
with the launcher variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) set by the test,
reading through its node's cache.

Reads a JSON config (argv[1]): url, storage_options, ram_dir, ssd_dir, ram_bytes, ssd_bytes, seed,
epochs (list), num_workers, out_dir; optional resume (path of a state, or of a list of every old
rank's state, to load before the first epoch) and stop ([epoch, n]: stop that epoch after n samples
and save the state to ``out_dir/state_rank{r}.json``: the dataset's ``state_dict()`` with
num_workers=0, else that of a StatefulDataLoader, saved in its workers; n a multiple of 16 then) and
payload_size (samples are ``tests.helpers.faults`` samples: check every sample's bytes) and
persistent_workers (one DataLoader for every epoch, its workers kept, as training jobs run; not
with stop) and lockstep (a TCP port: the ranks join a gloo process group there and all-reduce
once per batch, as data-parallel training does, so no rank runs ahead of the others) and
ram_by_node (each node's ram_bytes) and placement and peers (``PeerConfig`` keywords; ``binds``,
a list by node rank, gives each node its ``bind``) and pause ([epoch, n]: after n samples of that
epoch write ``paused{e}_rank{r}`` and wait for the test's ``resume{e}``) and linger (after the last
epoch, wait for the test's ``exit`` file: the node's peer server stays up for another job). Per
epoch it writes the sample ids it got to ``out_dir/epoch{e}_rank{r}.json`` and its node cache's stats to
``stats{e}_rank{r}.json`` (with ``bad``: the samples whose bytes were wrong), then waits for the
test's ``go{e}`` file (so the test reads the proxy's counters between epochs). SIGUSR1 writes every
thread's stack to the log (``Job`` sends it to a rank's processes, its DataLoader workers too, when
an epoch does not finish in time).
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from datacache import CacheConfig, PeerConfig, StreamingDataset
from tests.helpers.faults import payload

faulthandler.register(signal.SIGUSR1, all_threads=True)  # inherited by the forked workers


def _write(path: str, value: object) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def _wrong(batch: dict, size: int | None) -> int:
    """How many samples of ``batch`` (lists of ``i`` and ``data``) carry other bytes than their
    payload; 0 without ``size`` (samples of another kind)."""
    if not size:
        return 0
    return sum(bytes(d) != payload(int(i), size) for i, d in zip(batch["i"], batch["data"]))


def _wait(path: str) -> None:
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} from the test")
        time.sleep(0.02)


def _lockstep(port: int | None, rank: int) -> Any:
    """A per-batch step that waits for every rank (a gloo all-reduce), or nothing without a port."""
    if not port:
        return lambda: None
    import torch
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=int(os.environ["WORLD_SIZE"]))
    one = torch.zeros(1)
    return lambda: tdist.all_reduce(one)


def main() -> int:
    # warnings as Python's default shows them, and why each peer fetch fell back (the tests print it)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("datacache.peer").setLevel(logging.INFO)
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    rank, out = int(os.environ["RANK"]), cfg["out_dir"]
    node = rank // int(os.environ["LOCAL_WORLD_SIZE"])
    ram = cfg["ram_by_node"][node] if cfg.get("ram_by_node") else cfg["ram_bytes"]
    cache = CacheConfig(ram_bytes=ram, ssd_bytes=cfg["ssd_bytes"], ram_dir=cfg["ram_dir"], ssd_dir=cfg["ssd_dir"])
    peers = None
    if cfg.get("peers") is not None:
        binds = cfg.get("binds")
        peers = PeerConfig(**cfg["peers"], **({"bind": binds[node]} if binds else {}))
    ds = StreamingDataset(cfg["url"], storage_options=cfg["storage_options"], cache=cache, seed=cfg["seed"],
                          placement=cfg.get("placement", "node"), peers=peers)
    if cfg.get("resume"):
        with open(cfg["resume"]) as f:
            ds.load_state_dict(json.load(f))
    _write(os.path.join(out, f"layout_rank{rank}.json"),
           {"dp_rank": ds.dp_rank, "dp_size": ds.dp_size, "num_nodes": ds.num_nodes})
    step = _lockstep(cfg.get("lockstep"), rank)
    stop_epoch, stop_after = cfg.get("stop") or (None, None)
    pause_epoch, pause_after = cfg.get("pause") or (None, None)

    def pause(epoch: int, seen: int, before: int) -> None:
        if epoch == pause_epoch and before < pause_after <= seen:
            _write(os.path.join(out, f"paused{epoch}_rank{rank}"), seen)
            _wait(os.path.join(out, f"resume{epoch}"))
    kept = DataLoader(ds, batch_size=16, num_workers=cfg["num_workers"], persistent_workers=True) \
        if cfg.get("persistent_workers") else None
    for epoch in cfg["epochs"]:
        ds.set_epoch(epoch)  # keeps a loaded state of the same epoch
        ids: list[int] = []
        bad = 0
        size = cfg.get("payload_size")
        stopping = epoch == stop_epoch
        if cfg["num_workers"]:
            loader = kept or (StatefulDataLoader if stopping else DataLoader)(ds, batch_size=16,
                                                                           num_workers=cfg["num_workers"])
            for batch in loader:
                step()
                before = len(ids)
                ids += batch["i"].tolist()
                pause(epoch, len(ids), before)
                bad += _wrong(batch, size)
                if stopping and len(ids) >= stop_after:
                    _write(os.path.join(out, f"state_rank{rank}.json"), loader.state_dict())
                    break
            del loader
        else:
            for sample in ds:
                ids.append(int(sample["i"]))
                pause(epoch, len(ids), len(ids) - 1)
                bad += _wrong({"i": [sample["i"]], "data": [sample.get("data")]}, size)
                if stopping and len(ids) == stop_after:
                    _write(os.path.join(out, f"state_rank{rank}.json"), ds.state_dict())
                    break
        _write(os.path.join(out, f"epoch{epoch}_rank{rank}.json"), ids)
        got = ds.stats()
        stats = {**{k: v for k, v in got.items() if isinstance(v, (int, float))}, "bad": bad,
                 **{f"peers_{k}": v for k, v in got["peers"].items()}}
        tier = ds.source.peers
        if tier is not None:  # how many of the shards this node owns it holds now
            owned = tier.owned().tolist()
            stats.update(owned=len(owned), owned_bytes=sum(ds.manifest.shards[i].bytes for i in owned),
                         owned_held=sum(ds.cache.contains(ds.manifest.cache_key(i)) is not None for i in owned))
        _write(os.path.join(out, f"stats{epoch}_rank{rank}.json"), stats)
        _wait(os.path.join(out, f"go{epoch}"))
    del kept
    if cfg.get("linger"):
        _wait(os.path.join(out, "exit"))
    ds.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
