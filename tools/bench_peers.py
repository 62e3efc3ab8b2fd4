"""The ``peers`` scenario of ``tools/bench.py``: the cluster as one cache (issue 39).

``--nodes`` (4) simulated nodes (``tools/bench_nodes.py``: one rank process with its DataLoader
workers, its own ``/dev/shm`` and ``TMPDIR``), each with a RAM tier of C = 0.3 D (no SSD tier),
``placement="global"`` (every epoch a full reshuffle across all nodes), 3 epochs. The object store
sits behind the bench's one store link (``--bandwidth``, ``--latency``: 50 MB/s, 20 ms), and every
node's peer server behind a link of its own (``tools/slowlink.py``; ``--peer-bandwidth``, default 4 x
the store link, ``--peer-latency``, default 2 ms), so every byte a node serves to another is
metered at that node's link, as the store's are at the store link.

Systems: ``datacache`` (the peer tier on: ``DATACACHE_PEERS`` and ``DATACACHE_PEER_TOKEN`` set for
each node), ``datacache+nopeers`` (the same with nothing configured: the tier off, the "before"),
and Streaming and LitData configured for several nodes as their docs say (``bench_nodes.loader_kwargs``
and ``NNODES``); they have no peer tier and read everything from the store.

How a node reaches the others' servers through their links: every node gets the same
``DATACACHE_PEERS``, the links' addresses in node-rank order (entry ``j`` forwards to node ``j``'s
server; the tier places shards by these addresses, so every node must see the same list), and
``DATACACHE_PEER_BIND``, its own server's address behind its link (``PeerConfig.bind``: where the
server listens when that is not its entry). The token is one per run.

Figures, per epoch (``finish`` and ``summary``):

- store MB: bytes the store link carried, all nodes together (metered at the proxy);
- peer MB: bytes all peer links carried (each node's uploads, metered at its link);
- each node's wall (its own epoch, ``own_wall``) against its **bound**: the larger of
  (a) the store link time of the bytes the cluster *must* take from the store: D in the first
  epoch (one download per shard per cluster), max(0, D - sum C) after it (the cluster-wide
  bound of issue 39: 0 here, since 4 x 0.3 D > D), and
  (b) the node's compute: its batches x the simulated step as measured in the same run.
  A node cannot finish before either; bytes a system reads beyond the bound count against it.
  ``link s`` beside it is the bound of the links as they were used: max(store bytes / store
  bandwidth, the busiest peer link's bytes / peer bandwidth);
- exactly once: every sample id read by some node, the total the dataset's size plus at most the
  plan's padding (each rank's ids as a bitmap, joined here; ``ids_bits``), per node how much of
  the dataset its ranks have seen so far (``coverage``), which the ``shuffle`` report uses to
  put global placement beside the node-sticky default (``placement_table``).

Thread-safety: ``PeerLinks`` is used by the bench's one thread (its links run their own loop
threads); the other functions are pure.
"""
from __future__ import annotations

import base64
import os
import secrets
import statistics
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from tools.bench_launch import RANK_KEYS, _free_port

SCENARIO = "peers"
PEER_FACTOR = 4.0  # the peer links' default bandwidth, x the store link's
PEER_LATENCY = 0.002  # s per request on a peer link (one switch hop)
ENV_PEERS, ENV_TOKEN, ENV_BIND = "DATACACHE_PEERS", "DATACACHE_PEER_TOKEN", "DATACACHE_PEER_BIND"
STAT_KEYS = ("bytes_from_peers", "bytes_from_store", "bytes_served", "corrupt", "fallbacks", "hedged", "refused")


def scenario_fields(a: Any) -> dict[str, Any]:
    """The scenario's fields beside ``tools/bench.py``'s defaults."""
    return {"phases": ["measured"] * 3, "nodes": a.nodes, "placement": "global",
            "peer_bandwidth": a.peer_bandwidth or PEER_FACTOR * a.bandwidth, "peer_latency": a.peer_latency}


def add_args(p: Any) -> None:
    p.add_argument("--peer-bandwidth", default=None,
                   help=f"peers scenario: each node's peer link, bytes/s (default {PEER_FACTOR:g} x --bandwidth)")
    p.add_argument("--peer-latency", type=float, default=PEER_LATENCY, help="peers scenario: s per peer request")


PLACEMENTS = {"node-sticky": "node", "global": "global"}  # the shuffle scenario's multi-node variants


def placement_variant(sc: dict[str, Any], variant: str, nodes: int) -> dict[str, Any]:
    """A copy of scenario ``sc``; for a placement variant of the shuffle scenario (``PLACEMENTS``)
    run on ``nodes`` simulated nodes with that placement (each node's cache as the scenario's)."""
    sc = dict(sc)
    if variant in PLACEMENTS:
        sc.update(nodes=nodes, placement=PLACEMENTS[variant])
    return sc


def record_fields(sc: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """The fields a run's records carry for its placement and peer links."""
    out: dict[str, Any] = {}
    if sc.get("placement"):
        out.update(nodes=sc["nodes"], placement=sc["placement"])
    if sc.get("name") == SCENARIO:
        out.update(peer_bandwidth=sc["peer_bandwidth"], peer_latency=sc["peer_latency"],
                   peer_configured=bool(spec.get("peer_env")))
    return out


def tier_wanted(system: str, variant: str, sc: dict[str, Any]) -> bool:
    """Whether this run configures the peer tier: datacache's default variant in the peers scenario."""
    return sc.get("name") == SCENARIO and system == "datacache" and variant == "default"


# ---------------------------------------------------------------- the links, per run
class PeerLinks:
    """One metering slow link per simulated node, in front of that node's peer server (a free
    loopback port chosen here, which the node binds: ``binds[k]``). ``peers``: every node's
    ``DATACACHE_PEERS`` (the links). Context manager; the links stop on exit."""

    def __init__(self, nodes: int, bandwidth: float, latency: float) -> None:
        from tools.slowlink import SlowLink

        self.servers = [_free_port() for _ in range(nodes)]
        self.links = [SlowLink("127.0.0.1", port, bandwidth=bandwidth, latency=latency) for port in self.servers]

    def __enter__(self) -> "PeerLinks":
        for link in self.links:
            link.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for link in self.links:
            link.stop()

    @property
    def peers(self) -> str:
        return ",".join(f"127.0.0.1:{link.port}" for link in self.links)

    @property
    def binds(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.servers]

    def snapshot(self) -> dict[str, Any]:
        """The links' counters for the runner's meter: the sum and each node's link's bytes."""
        snaps = [link.snapshot() for link in self.links]
        return {"peer_bytes_down": sum(s["bytes_down"] for s in snaps),
                "peer_requests": sum(s["requests"] for s in snaps), "peer_links": [s["bytes_down"] for s in snaps]}


@contextmanager
def around_run(sc: dict[str, Any], spec: dict[str, Any], meter: Any, system: str, variant: str) -> Iterator[None]:
    """For the peers scenario: the peer links of one run, metered through ``meter`` (every system
    gets them, so every system's records carry peer bytes, 0 without a tier), and for datacache's
    default variant the peer list, each node's bind address and the token in ``spec``. Elsewhere: nothing."""
    if sc.get("name") != SCENARIO:
        yield
        return
    with PeerLinks(sc["nodes"], float(sc["peer_bandwidth"]), float(sc["peer_latency"])) as links:
        if tier_wanted(system, variant, sc):
            spec["peer_env"] = {"peers": links.peers, "binds": links.binds, "token": secrets.token_hex(16)}
        meter.extra = links.snapshot
        try:
            yield
        finally:
            meter.extra = None


def node_env(spec: dict[str, Any]) -> None:
    """In a node's runner process, before the dataset is made: the peer list, this node's bind
    address and the token, or none of them (one inherited from the bench's own environment is
    removed: the tier off)."""
    for name in (ENV_PEERS, ENV_TOKEN, ENV_BIND):
        os.environ.pop(name, None)
    peer = spec.get("peer_env")
    if peer:
        os.environ[ENV_PEERS] = peer["peers"]
        os.environ[ENV_BIND] = peer["binds"][int(os.environ.get("BENCH_NODE", "0"))]
        os.environ[ENV_TOKEN] = peer["token"]


def dataset_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """datacache's extra constructor arguments in this scenario: ``placement``."""
    placement = spec["scenario"].get("placement")
    return {"placement": placement} if placement else {}


# ---------------------------------------------------------------- in the runner
def peer_delta(m0: dict[str, Any], m1: dict[str, Any]) -> dict[str, Any]:
    """The epoch's peer-link bytes from two meter readings (none when the meter has no peer links)."""
    if "peer_bytes_down" not in m1 or "peer_bytes_down" not in m0:
        return {}
    return {"peer_bytes": m1["peer_bytes_down"] - m0["peer_bytes_down"],
            "peer_requests": m1["peer_requests"] - m0["peer_requests"],
            "peer_link_bytes": [b - a for a, b in zip(m0["peer_links"], m1["peer_links"])]}


def ids_bits(batches: list[np.ndarray], n: int) -> str:
    """The set of sample ids in ``batches`` (of ``n``) as a base64 bitmap."""
    seen = np.zeros(n, dtype=bool)
    for ids in batches:
        seen[ids[(ids >= 0) & (ids < n)]] = True
    return base64.b64encode(np.packbits(seen).tobytes()).decode()


def _bits(text: str, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(base64.b64decode(text), dtype=np.uint8))[:n].astype(bool)


def peer_stats(stats: dict[str, Any]) -> dict[str, Any] | None:
    """The node's ``stats()["peers"]`` counters (None where this datacache has no peer tier)."""
    p = stats.get("peers")
    if not isinstance(p, dict):
        return None
    return {k: p[k] for k in STAT_KEYS if isinstance(p.get(k), (int, float))}


# ---------------------------------------------------------------- after a run (tools/bench.py)


def finish(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A multi-node run's records (one per epoch, each with ``rank_extra``: every node's
    ``ids_bits`` and ``peer_stats``) with the joined figures: ``covered`` (distinct samples over
    all nodes), ``exactly_once`` (every sample read, no more than the padding over), ``coverage``
    (each node's share of the dataset seen in this and earlier epochs), and the node's peer
    counters for the epoch (``node_peer_stats``: the cumulative counters' differences). The
    bitmaps are dropped."""
    seen: list[np.ndarray] = []
    last: list[dict[str, Any] | None] = []
    for rec in sorted(records, key=lambda r: r.get("epoch", 0)):
        extra = rec.pop("rank_extra", None)
        for key in RANK_KEYS:  # rank 0's own, also in ``extra``
            rec.pop(key, None)
        if not extra or "n" not in rec:
            continue
        n = rec["n"]
        bits = [_bits(x["ids_bits"], n) if x.get("ids_bits") else np.zeros(n, dtype=bool) for x in extra]
        union = np.logical_or.reduce(bits)
        seen = [b if not seen else seen[k] | b for k, b in enumerate(bits)]
        total = sum(rec.get("rank_samples") or [rec["samples"]])
        ranks = len(bits)
        rec["covered"] = int(union.sum())
        rec["exactly_once"] = bool(rec["covered"] == n and n <= total < n + ranks * max(rec.get("batch_size", 1), 1))
        rec["coverage"] = [round(float(s.mean()), 4) for s in seen]
        stats = [x.get("peer_stats") for x in extra]
        if any(s is not None for s in stats):
            prev = last or [None] * len(stats)
            rec["node_peer_stats"] = [{k: v - (p or {}).get(k, 0) for k, v in s.items()} if s else None
                                      for s, p in zip(stats, prev)]
            rec["peer_tier"] = True
        else:
            rec["peer_tier"] = False
        last = stats
    return records


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def epoch_figures(rec: dict[str, Any], cluster_cache: float) -> dict[str, Any]:
    """One epoch's figures: store and peer bytes, the needed store bytes and the bound (module
    docstring), each node's own wall over its bound."""
    D, first = rec["D"], rec["epoch"] == 0
    needed = D if first else max(0.0, D - cluster_cache)
    store_s = needed / rec["bandwidth"]
    walls = rec.get("rank_own_walls") or [rec["own_wall"]]
    step = rec["compute"] / max(rec["batches"], 1)
    batches = [max(1, round(s / rec["batch_size"])) for s in (rec.get("rank_samples") or [rec["samples"]])]
    bounds = [max(store_s, b * step) for b in batches]
    peer_bw = rec.get("peer_bandwidth") or float("inf")
    link_s = max([rec["remote_bytes"] / rec["bandwidth"]] + [b / peer_bw for b in rec.get("peer_link_bytes", [])])
    ratios = [w / b for w, b in zip(walls, bounds) if b > 0]
    return {"store": rec["remote_bytes"], "peer": rec.get("peer_bytes", 0), "needed": needed, "wall": rec["wall"],
            "bound": max(bounds), "link": link_s, "best": min(ratios, default=float("nan")),
            "worst": max(ratios, default=float("nan")), "once": float(rec.get("exactly_once", False)),
            "compute": rec["compute"]}


def summary(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One (peers, system, rep) that completed: every scenario's totals (wall, bound, remote per
    epoch, samples, so medians, charts and the progress line work) and per epoch ``e{i}_*``."""
    r0 = recs[0]
    C = (r0.get("C") or 0) * r0.get("nodes", 1)
    eps = [epoch_figures(r, C) for r in sorted(recs, key=lambda r: r["epoch"])]
    wall = sum(e["wall"] for e in eps)
    samples = sum(r["samples"] for r in recs)
    out: dict[str, Any] = {
        "D": r0["D"], "C": r0.get("C"), "wall": wall, "wait_pct": 100 * sum(r["wait"] for r in recs) / wall,
        "remote": [e["store"] for e in eps], "peer": [e["peer"] for e in eps], "samples": samples,
        "samples_s": samples / wall, "first_batch": recs[0].get("first_batch") or 0.0,
        "link": sum(e["link"] for e in eps), "compute": sum(e["compute"] for e in eps), "memcpy": 0.0,
        "bound": sum(e["bound"] for e in eps), "exactly_once": float(all(e["once"] for e in eps)),
        "peer_tier": float(bool(r0.get("peer_tier"))), "cluster_cache": C, "epochs": len(eps)}
    for i, e in enumerate(eps):
        out.update({f"e{i}_{k}": v for k, v in e.items()})
    q = [r["quality"] for r in recs if r.get("quality") is not None]
    if q:
        out["quality"] = sum(q) / len(q)
    return out


def checks(dc: dict[str, Any]) -> list[tuple[bool | None, str]]:
    """datacache's targets in the peers scenario (issue 39): store bytes after the first epoch
    <= 1.02 x max(0, D - sum C) (with a floor of 1 % of D for a bound of 0: the manifest and
    the odd retried range), each node's cold epoch <= 1.10 x its bound, every epoch exactly once."""
    D, allowed = dc["D"], max(0.0, dc["D"] - dc["cluster_cache"])
    later = [dc[f"e{i}_store"] for i in range(1, int(dc["epochs"]))]
    worst = max(later, default=0.0)
    tier = "" if dc.get("peer_tier") else " (no peer tier in this build)"
    return [(worst <= max(1.02 * allowed, 0.01 * D),
             f"store after epoch 1 {worst / D:.3f} D (<= 1.02 x max(0, D - sum C) = {allowed / D:.2f} D){tier}"),
            (dc["e0_worst"] <= 1.10,
             f"each node's cold epoch {dc['e0_best']:.2f}-{dc['e0_worst']:.2f}x bound (<=1.10)"),
            (dc["exactly_once"] == 1, "every epoch exactly once over the nodes")]


# ---------------------------------------------------------------- the report
def _runs(records: list[dict[str, Any]], scenario: str) -> dict[str, list[list[dict[str, Any]]]]:
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for r in records:
        if r.get("scenario") == scenario and r.get("rep", 0) >= 0:
            runs.setdefault(r["system"], {}).setdefault(r["rep"], []).append(r)
    return {s: [sorted(rs, key=lambda r: r.get("epoch", 0)) for rs in reps.values()] for s, reps in runs.items()}


def _failed(rs: list[dict[str, Any]]) -> str | None:
    r0 = rs[0]
    if "wall" not in r0:
        return " ".join(str(r0.get("unavailable") or r0.get("error") or "no result").split())
    return next((f"aborted: {r['aborted']}" for r in rs if "aborted" in r), None)


def describe(records: list[dict[str, Any]]) -> str:
    r = next((r for r in records if r.get("scenario") == SCENARIO and "D" in r), None)
    if r is None:
        return ""
    nodes, D, C = r.get("nodes", "?"), r["D"], r.get("C") or 0
    pb = r.get("peer_bandwidth") or 0
    return (f"{nodes} simulated nodes, `placement=\"global\"`, each a RAM tier of C = {C / 1e6:.0f} MB "
            f"({C / D:.2f} D; sum C = {nodes * C / D:.2f} D), D = {D / 1e6:.0f} MB; the store behind the "
            f"{r['bandwidth'] / 1e6:.0f} MB/s, {r['latency'] * 1e3:.0f} ms link, each node's peer server behind a "
            f"{pb / 1e6:.0f} MB/s, {1e3 * (r.get('peer_latency') or 0):.0f} ms link of its own (both metered at the "
            "proxy). store MB / peer MB: bytes the store link / all peer links carried. bound: per node, the larger "
            "of the store link time of the bytes the cluster must fetch (D in epoch 1, max(0, D - sum C) after) and "
            "the node's compute (its batches x the measured step); link s: max(store MB / store bandwidth, busiest "
            "peer link / peer bandwidth). Exactly once: every sample read by some node, the total over by at most "
            "the plan's padding. datacache: the peer tier on (`DATACACHE_PEERS`, `DATACACHE_PEER_TOKEN`); "
            "datacache+nopeers: nothing configured (the tier off); Streaming and LitData as in the nodes scenario.")


def report(records: list[dict[str, Any]], order: Any = None) -> str:
    """The peers scenario's table (medians over reps), one row per system and epoch; "" without
    peers records."""
    runs = _runs(records, SCENARIO)
    if not runs:
        return ""
    rows = ["| system | n | epoch | store MB | peer MB | store / D | wall s | bound s | link s | each node's wall / "
            "bound (best-worst) | exactly once | peer tier: fallbacks · hedged · corrupt · refused |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for system in sorted(runs, key=order or (lambda s: s)):
        reps = runs[system]
        ok = [rs for rs in reps if _failed(rs) is None]
        if not ok:
            rows.append(f"| {system} | 0 of {len(reps)} | {_failed(reps[0])[:200]} | | | | | | | | | |")
            continue
        sums = [summary(rs) for rs in ok]
        n = str(len(ok)) if len(ok) == len(reps) else f"{len(ok)} of {len(reps)}"
        for e in range(min(int(s["epochs"]) for s in sums)):
            def med(k: str) -> float:
                return _median([s[f"e{e}_{k}"] for s in sums])  # noqa: B023 - used at once
            tier = _tier_cell([rs[e] for rs in ok])
            rows.append(f"| {system} | {n} | {e + 1} | {med('store') / 1e6:.1f} | {med('peer') / 1e6:.1f} "
                        f"| {med('store') / sums[0]['D']:.2f} | {med('wall'):.2f} | {med('bound'):.2f} "
                        f"| {med('link'):.2f} | {med('best'):.2f}-{med('worst'):.2f} "
                        f"| {'yes' if all(s[f'e{e}_once'] for s in sums) else '**no**'} | {tier} |")
    return describe(records) + "\n\n" + "\n".join(rows)


def _tier_cell(recs: list[dict[str, Any]]) -> str:
    """The peer tier's own counters for one epoch (sums over nodes; the first rep), or '-'."""
    stats = recs[0].get("node_peer_stats")
    if not stats:
        return "-"
    tot = {k: sum((s or {}).get(k, 0) for s in stats) for k in ("fallbacks", "hedged", "corrupt", "refused")}
    return " · ".join(f"{tot[k]:.0f}" for k in ("fallbacks", "hedged", "corrupt", "refused"))


# ---------------------------------------------------------------- placement beside the shuffle scenario
# (scenario, system, placement shown): the shuffle scenario's placement variants first
PLACEMENT_SOURCES = (("shuffle", "datacache+node-sticky", "node-sticky (default)"),
                     ("shuffle", "datacache+global", "global"), ("nodes", "datacache", "node-sticky (default)"),
                     (SCENARIO, "datacache+nopeers", "global"),
                     (SCENARIO, "datacache", "global, peer tier on"))


def placement_table(records: list[dict[str, Any]]) -> str:
    """datacache's shuffle quality on several nodes, node-sticky (the default placement) beside
    global, per epoch: the quality of every rank's batches pooled (``tools/bench_quality.py``),
    the share of the dataset each node has seen by the end of the epoch (mean over nodes) and the
    store's MB; from the shuffle scenario's placement variants (and the nodes and peers scenarios
    where the run has them). "" when none ran."""
    rows = []
    for scenario, system, label in PLACEMENT_SOURCES:
        reps = [rs for rs in _runs(records, scenario).get(system, []) if _failed(rs) is None]
        if not reps:
            continue
        epochs = min(len(rs) for rs in reps)

        def per_epoch(fig: Any, fmt: str) -> str:
            return " / ".join(format(_median([fig(rs[e]) for rs in reps]), fmt) for e in range(epochs))  # noqa: B023
        q = per_epoch(lambda r: r.get("quality") or 0.0, ".2f")
        cov = per_epoch(lambda r: statistics.mean(r.get("coverage") or [float("nan")]), ".2f")
        mb = per_epoch(lambda r: r["remote_bytes"] / 1e6, ".1f")
        rows.append(f"| {label} | {system} ({scenario}) | {len(reps)} | {reps[0][0].get('nodes', '?')} | {q} | {cov} "
                    f"| {mb} |")
    if not rows:
        return ""
    return ("Placement on several nodes (datacache, each node one rank process with its workers): the quality of "
            "every rank's batches pooled, the share of the dataset a node's ranks have seen by the end of each "
            "epoch (mean over nodes) and the store's MB, per epoch (shuffle: cold / warm). Node-sticky placement "
            "keeps each node on its own shards (the same share every epoch); global placement reshuffles all "
            "shards over all nodes.\n\n"
            "| placement | system (scenario) | n | nodes | quality per epoch | dataset seen per node, by epoch "
            "| store MB per epoch |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows))


__all__ = ["PLACEMENTS", "PeerLinks", "around_run", "checks", "dataset_kwargs", "finish", "ids_bits", "node_env",
           "peer_delta", "peer_stats", "placement_table", "placement_variant", "record_fields", "report",
           "scenario_fields", "summary"]
