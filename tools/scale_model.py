"""A model of many nodes against one object store, computed from the real plan code.

    python tools/scale_model.py [--nodes 8,64,1000] [--ranks 8] [--workers 2] [--dataset 10TB]
                                [--shard 64MB] [--cache 1TB] [--part 8MB] [--bandwidth 1.25GB]
                                [--epochs 3] [--compute-s 0] [--png docs/bench/scale_model.png] [--json]

For each node count it builds the run's node assignment and every node's epoch plans with
``datacache.plan.epoch`` (node placement: the default with several nodes), then per epoch:

- bytes: each node reads its share S_k in the first epoch and max(0, S_k - C_k) in each later one
  (the clairvoyant cache's bound; S_k from the real plan, spill shards included);
- GETs: ``ceil(shard / part)`` ranged GETs per remote shard (``TransferConfig.part_bytes``);
- time: every node fetches its remote shards in the order its consumers first need them (the
  plans' node-clock times), starting ``lookahead`` ahead of need, one node link of ``bandwidth``
  bytes/s each; the epoch lasts as long as the slowest node's link (or ``--compute-s``, if longer);
- GET/s: the mean over the epoch and the peak over 1 s windows, for all nodes together, against
  S3's 5,500 GET/s per prefix, with what to do when over: spread the shards over more prefixes,
  use larger parts, or cap each node with the store's ``max_requests_per_s``.

``predict_bytes`` is the same computation for a small job (tools/bench.py's ``nodes`` scenario
checks it against a measured run).

**The peer tier** (issue 39; ``peer_rows``): the object store's egress bytes, GETs and GET/s per
epoch, and the bytes the nodes serve each other, for node-sticky and global placement, each with
and without the peer tier. Its assumptions, printed with the table (``PEER_ASSUMPTIONS``):

- node placement: the shares S_k of the real plan (as above). Without peers node k reads S_k in
  epoch 1 and max(0, S_k - C) after; with peers the store serves each shard once per cluster (D in
  epoch 1; the shards two nodes share come from the peer that fetched them) and max(0, D - N C)
  after (the cluster holds min(D, N C) distinct bytes: duplicates never crowd out a shard only one
  node holds); a node's other misses come from peers.
- global placement (``placement="global"``): every epoch a fresh uniform permutation, each node a
  random 1/N of the shards. Without peers a node can hold only shards it read before: by epoch e
  it has seen 1 - (1 - 1/N)^(e-1) of the dataset, and a clairvoyant cache (datacache's eviction
  knows the next epoch's plan) keeps up to C of those it reads next, so the store serves
  D x max(1 - seen, 1 - N C / D) (the 4-node bench measures 0.77 and 0.52 D against 0.75 and
  0.56). With peers, as node placement: D, then max(0, D - N C); a node's cache holds a C / D share
  of the shards (at most all), the rest of its share comes from peers.
- peer bytes: the misses the store does not serve. In epoch 1 that counts only shards two nodes
  read; a tier whose owners download for the readers moves up to (1 - 1/N) D more between nodes
  (the 4-node bench measures 1.19 D, the next epoch's prefetch included): neither egress nor GETs.
- time: an epoch lasts as long as the slowest node's store bytes take at ``--bandwidth`` (each node
  fetches the shards it owns, the store's bytes spread evenly over the nodes with peers), or its
  peer bytes at ``--peer-bandwidth`` (the cluster fabric, apart from the store path), or
  ``--compute-s``, whichever is longest; GET/s = ``ceil(bytes / part)`` GETs over that time.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from datacache.config import format_size, parse_size  # noqa: E402
from datacache.plan.epoch import PlanSpec, build_plan  # noqa: E402

S3_GETS_PER_PREFIX = 5500


def node_needs(counts: np.ndarray, sizes: np.ndarray, spec: PlanSpec, node: int,
               ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """(shards node ``node`` reads in ``spec.epoch``, first-need node-clock time of each), from
    every consumer's shards-only plan."""
    first: dict[int, float] = {}
    for r in range(node * ranks, (node + 1) * ranks):
        for w in range(spec.num_workers):
            plan = build_plan(counts, replace(spec, dp_rank=r, worker_id=w), shards_only=True)
            for shard, t in plan.shard_times(0):
                if t < first.get(shard, 2.0):
                    first[shard] = t
    shards = np.array(sorted(first, key=first.__getitem__), dtype=np.int64)
    return shards, np.array([first[s] for s in shards.tolist()])


def predict_bytes(counts: np.ndarray, sizes: np.ndarray, *, nodes: int, ranks: int, workers: int, cache: int,
                  epochs: int, seed: int = 0) -> list[int]:
    """Remote bytes per epoch for all nodes together: S_k in the first epoch, then S_k less the
    whole shards of it that fit in C (at most max(0, S_k - C) once shards are small against C)."""
    spec = PlanSpec(seed=seed, dp_size=nodes * ranks, num_workers=workers, num_nodes=nodes, shard_bytes=sizes)
    first, later = 0, 0
    for k in range(nodes):
        mine = np.sort(sizes[node_needs(counts, sizes, spec, k, ranks)[0]])[::-1]
        kept, room = 0, cache
        for b in mine.tolist():  # the cache holds whole shards: the largest that fit
            if b <= room:
                kept, room = kept + b, room - b
        first += int(mine.sum())
        later += int(mine.sum()) - kept
    return [first] + [later] * (epochs - 1)


def _gets(needs: list[tuple[np.ndarray, np.ndarray]], remote: list[np.ndarray], shard_bytes: int, part: int,
          bandwidth: float, lookahead: float, compute_s: float) -> tuple[np.ndarray, float]:
    """GET completion times (s) of all nodes in one epoch, and the epoch's length."""
    parts = math.ceil(shard_bytes / part)
    per_get = part / bandwidth
    link_s = max((len(r) * parts * per_get for r in remote), default=0.0)
    length = max(link_s, compute_s, 1e-9)
    times = []
    for (_, need), miss in zip(needs, remote):
        if len(miss) == 0:
            continue
        start = np.maximum(need[miss] * length - lookahead / bandwidth, 0.0)
        # one link per node: each part follows the previous one, never before its shard's start
        t = np.repeat(start, parts) + per_get
        done = np.maximum.accumulate(t - np.arange(len(t)) * per_get) + np.arange(len(t)) * per_get
        times.append(done)
    return (np.concatenate(times) if times else np.zeros(0)), length


def model(nodes: int, a: argparse.Namespace) -> dict[str, Any]:
    shard, part, cache = parse_size(a.shard), parse_size(a.part), parse_size(a.cache)
    n_shards = parse_size(a.dataset) // shard
    sizes = np.full(n_shards, shard, dtype=np.int64)
    counts = np.full(n_shards, a.samples_per_shard, dtype=np.int64)
    sizes.flags.writeable = counts.flags.writeable = False
    bandwidth = parse_size(a.bandwidth)
    lookahead = parse_size(a.lookahead) * a.workers * a.ranks
    spec = PlanSpec(seed=a.seed, dp_size=nodes * a.ranks, num_workers=a.workers, num_nodes=nodes, shard_bytes=sizes)
    needs = [node_needs(counts, sizes, spec, k, a.ranks) for k in range(nodes)]
    epochs = []
    for e in range(a.epochs):
        remote = []
        for shards, _ in needs:
            have = len(shards) * shard
            misses = len(shards) if e == 0 else max(0, math.ceil((have - cache) / shard))
            # later epochs: the misses spread over the node's read order (the cache keeps the rest)
            remote.append(np.linspace(0, len(shards) - 1, misses).round().astype(np.int64) if misses else
                          np.zeros(0, dtype=np.int64))
        times, length = _gets(needs, remote, shard, part, bandwidth, lookahead, a.compute_s)
        per_s = np.bincount(times.astype(np.int64)) if len(times) else np.zeros(1)
        gets = int(len(times))
        epochs.append({"epoch": e + 1, "remote_bytes": int(sum(len(r) for r in remote) * shard), "gets": gets,
                       "seconds": round(length, 1), "gets_per_s_mean": round(gets / length, 1),
                       "gets_per_s_peak": int(per_s.max())})
    share = [len(s) * shard for s, _ in needs]
    peak = max(e["gets_per_s_peak"] for e in epochs)
    peers = peer_rows(share, n_shards * shard, nodes=nodes, cache=cache, epochs=a.epochs, part=part,
                      bandwidth=bandwidth, peer_bandwidth=parse_size(a.peer_bandwidth), compute_s=a.compute_s)
    return {"nodes": nodes, "ranks": a.ranks, "workers": a.workers, "shards": n_shards, "shard_bytes": shard,
            "share_bytes": {"min": min(share), "max": max(share)}, "cache_bytes": cache, "part_bytes": part,
            "bandwidth": bandwidth, "epochs": epochs, "advice": advice(peak, nodes, part, shard), "peers": peers}


PEER_ASSUMPTIONS = (
    "node: shares S_k from the plan; no peers: S_k, then max(0, S_k - C) per node; peers: D once per cluster, "
    "then max(0, D - N C)",
    "global: a fresh uniform 1/N of the shards per node each epoch; no peers: D x max(1 - seen, 1 - N C / D), "
    "seen = 1 - (1 - 1/N)^(e-1) (a clairvoyant cache keeps what it read before and reads next); peers: as node",
    "time: the slowest node's store bytes / --bandwidth, its peer bytes / --peer-bandwidth, or --compute-s; "
    "GETs = ceil(bytes / part); egress = the store's bytes",
    "peer bytes: the misses the store does not serve; in epoch 1 only shards two nodes read (a tier whose owners "
    "download for the readers adds up to (1 - 1/N) D of peer traffic, which is neither egress nor a GET)")


def peer_rows(share: list[int], D: int, *, nodes: int, cache: int, epochs: int, part: int, bandwidth: float,
              peer_bandwidth: float, compute_s: float = 0.0) -> list[dict[str, Any]]:
    """Per (placement, peers, epoch): the store's egress bytes, GETs, GET/s, the peer bytes and the
    epoch's seconds (the module docstring's assumptions). ``share``: each node's bytes (the plan's
    node-placement shares)."""
    N, C = nodes, cache
    rows = []
    for placement in ("node", "global"):
        for peers in (False, True):
            for e in range(epochs):
                if peers:
                    store = D if e == 0 else max(0, D - N * C)
                    if placement == "node":
                        misses = sum(share) if e == 0 else sum(max(0, s - C) for s in share)
                    else:
                        misses = D if e == 0 else round(D * (1 - min(1.0, C / D)))
                    peer = max(0, misses - store)
                    node_store, node_peer = store / N, peer / N
                elif placement == "node":
                    per = [s if e == 0 else max(0, s - C) for s in share]
                    store, peer, node_store, node_peer = sum(per), 0, max(per), 0.0
                else:
                    seen = 1 - (1 - 1 / N) ** e
                    store = D if e == 0 else round(D * max(1 - seen, 1 - N * C / D))
                    peer, node_store, node_peer = 0, store / N, 0.0
                seconds = max(node_store / bandwidth, node_peer / peer_bandwidth, compute_s)
                gets = math.ceil(store / part) if store else 0
                rows.append({"placement": placement, "peers": peers, "epoch": e + 1, "store_bytes": int(store),
                             "gets": gets, "seconds": round(seconds, 1),
                             "gets_per_s": round(gets / seconds, 1) if seconds else 0.0, "peer_bytes": int(peer)})
    return rows


def advice(peak: int, nodes: int, part: int, shard: int) -> str:
    """What a user must do when the peak GET rate is over one S3 prefix's 5,500 GET/s."""
    if peak <= S3_GETS_PER_PREFIX:
        return f"within one prefix ({peak:,} <= {S3_GETS_PER_PREFIX:,} GET/s)"
    prefixes = math.ceil(peak / S3_GETS_PER_PREFIX)
    bigger = min(shard, part * prefixes)
    at_bigger = math.ceil(peak * part / bigger)
    out = [f"over one prefix ({peak:,} GET/s): spread the shards over >= {prefixes} prefixes (S3 scales per prefix)"]
    if bigger > part:
        left = math.ceil(at_bigger / S3_GETS_PER_PREFIX)
        out.append(f"or use parts of {format_size(bigger)} (TransferConfig(part_bytes=...): {at_bigger:,} GET/s"
                   + (f", still {left} prefixes)" if left > 1 else ")"))
    cap = max(1, S3_GETS_PER_PREFIX // nodes)
    out.append(f"or cap every node with TransferConfig(max_requests_per_s={cap}) (a node-wide budget; the "
               f"cold epoch then lasts {prefixes}x longer)")
    return "; ".join(out)


def _plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["nodes"] for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for e in range(len(results[0]["epochs"])):
        ax1.plot(n, [r["epochs"][e]["remote_bytes"] / 1e12 for r in results], "o-", label=f"epoch {e + 1}")
        ax2.plot(n, [r["epochs"][e]["gets_per_s_peak"] for r in results], "o-", label=f"epoch {e + 1} peak")
    ax2.plot(n, [r["epochs"][0]["gets_per_s_mean"] for r in results], "s--", label="epoch 1 mean")
    ax2.axhline(S3_GETS_PER_PREFIX, color="red", ls=":", label="S3: 5,500 GET/s per prefix")
    for ax, title in ((ax1, "remote TB per epoch (all nodes)"), (ax2, "object-store GET/s (1 s windows)")):
        ax.set_xscale("log")
        ax.set_xlabel("nodes (8 ranks each)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    ax2.set_yscale("symlog", linthresh=10)
    ax2.set_ylim(bottom=0)
    r0 = results[0]
    fig.suptitle(f"{r0['shards']:,} shards of {format_size(r0['shard_bytes'])}, "
                 f"cache {format_size(r0['cache_bytes'])}/node, part {format_size(r0['part_bytes'])}, "
                 f"{format_size(r0['bandwidth'])}/s per node")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="8,64,1000")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--dataset", default="10TB")
    p.add_argument("--shard", default="64MB")
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.add_argument("--cache", default="1TB", help="cache per node")
    p.add_argument("--part", default="8MB", help="bytes per ranged GET (TransferConfig.part_bytes)")
    p.add_argument("--bandwidth", default="1.25GB", help="per-node link, bytes/s")
    p.add_argument("--peer-bandwidth", default="12.5GB", help="per-node link to the other nodes (peer tier), bytes/s")
    p.add_argument("--lookahead", default="256MB", help="prefetch lookahead per consumer")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--compute-s", type=float, default=0.0, help="epoch length floor set by compute")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", default=None)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    results = [model(int(n), a) for n in a.nodes.split(",")]
    if a.png:
        _plot(results, a.png)
    if a.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'nodes':>6} {'share/node':>11} {'epoch':>5} {'remote':>9} {'GETs':>10} {'seconds':>8} "
          f"{'GET/s mean':>11} {'GET/s peak':>11}")
    for r in results:
        for e in r["epochs"]:
            print(f"{r['nodes']:>6} {format_size(r['share_bytes']['max']):>11} {e['epoch']:>5} "
                  f"{format_size(e['remote_bytes']):>9} {e['gets']:>10,} {e['seconds']:>8.0f} "
                  f"{e['gets_per_s_mean']:>11,.0f} {e['gets_per_s_peak']:>11,}")
        print(f"       -> {r['advice']}")
    print_peers(results)
    return 0


def print_peers(results: list[dict[str, Any]]) -> None:
    """The peer tier's table: the store's egress and GET/s with and without peers."""
    print("\nThe peer tier: object-store egress and GET/s per epoch, with and without peers. Model assumptions:")
    for line in PEER_ASSUMPTIONS:
        print(f"  - {line}")
    print(f"{'nodes':>6} {'placement':>9} {'peers':>5} {'epoch':>5} {'egress':>9} {'GETs':>10} {'seconds':>8} "
          f"{'GET/s':>9} {'peer bytes':>10}")
    for r in results:
        for row in r["peers"]:
            print(f"{r['nodes']:>6} {row['placement']:>9} {'on' if row['peers'] else 'off':>5} {row['epoch']:>5} "
                  f"{format_size(row['store_bytes']):>9} {row['gets']:>10,} {row['seconds']:>8.0f} "
                  f"{row['gets_per_s']:>9,.0f} {format_size(row['peer_bytes']):>10}")


if __name__ == "__main__":
    sys.exit(main())
