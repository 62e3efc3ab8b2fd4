"""datacache against its peers on one emulated WAN link: ``python tools/bench.py --out DIR``.

    python tools/bench.py [--quick] [--scenario cold,warm,limited,ranks,small,raw,throttle,nodes,shuffle,mix,peers,
                                     small-1024,raw-bytes,warm-bytes,limited-bytes,raw-shards,images]
                          [--systems datacache,streaming,litdata,fsspec]
                          [--variants default,tuned,matched,dropin,torch,window,placement,never,mds]
                          [--reps 3] [--storm 30] [--profile SCENARIO] [--readme README.md] --out DIR

Install: ``pip install -c constraints.txt -e '.[bench]'`` (constraints.txt pins the installed torch,
e.g. ``torch==2.13.0``), then the two peers WITHOUT their dependencies, which would pull a
torchvision that does not import beside this torch and pin numpy < 2.2:
``pip install --no-deps mosaicml-streaming==0.13.0 litdata==0.2.76``. A peer that cannot be
imported is reported as ``unavailable: <reason>``; ``tools/bench_systems.py`` documents each
system's settings and work-arounds.

One run starts SeaweedFS (objects under ``DIR/s3``, so the datasets written once are reused) behind
the slow link (``tools/slowlink.py``: per-request latency, one bandwidth cap shared by every
connection, bytes metered at the proxy), writes the same samples in each system's own format
(straight to the server, never across the link), then for each repetition runs every scenario for
every system in turn (the system order rotated per repetition), each (system, scenario, rep) in a
fresh process with fresh cache directories (RAM tier and peers' local caches in /dev/shm, datacache's
SSD tier under DIR). Scenarios (defaults; ``--quick``: 160 MB and 20 MB datasets, 1 rep):

- cold: D = 500 MB of 64 KiB samples in 16 MB shards, batch 32, 2 workers, 20 ms of compute per
  batch (sleep), empty cache.  warm: a fill epoch, then the measured epoch from the full cache.
- limited: cache budget C = D/2, 3 reshuffled epochs: remote bytes per epoch against D - C.
- ranks: ``torchrun --nproc_per_node=2`` (gloo) x 2 workers, cold: the node's remote bytes.
- small: 100 MB of 1 KiB samples, batch 256, warm, no compute: samples/s.
- raw: warm, no compute, 64 KiB samples: GB/s against the memcpy bound.
- throttle: cold, and once half of D has crossed the link the store throttles for ``--storm``
  seconds (every request answered 503 SlowDown, open connections cut: ``SlowLink.throttle``):
  wall time, requests answered 503, every sample exactly once.
- nodes: ``--nodes`` (4) simulated nodes, each one rank process (gloo) x 2 workers with its own
  cache of 0.3 D, 3 epochs, every system (each node has its own ``/dev/shm`` and ``TMPDIR``;
  Streaming gets ``num_canonical_nodes``, LitData ``NNODES``: ``tools/bench_nodes.py``): remote
  bytes and wall per epoch for all nodes together, each node's cold epoch against the link bound,
  and datacache's bytes against those ``tools/scale_model.predict_bytes`` predicts from the plan.
- shuffle: a cold epoch from an empty cache, then a warm epoch from the cache it filled, every
  system side by side: shuffle quality (overall, and per 5 % of the cold epoch), first-batch time,
  wall time and remote bytes of each epoch (its own table in the report).
- mix: three datasets of 50 / 30 / 20 % of D (each its own prefix, in each system's format) mixed by
  proportion 0.4 / 0.3 / 0.3 of an epoch of their total (one subsampled, one once, one repeated
  1.5 x), a cold epoch then a warm one, through each system's mixing API: samples per stream
  against expected, remote bytes against the drawn samples' bytes (``tools/bench_mix.py``; its own
  table in the report).
- small-1024, raw-bytes, warm-bytes, limited-bytes, raw-shards: derived from small, raw, warm, limited, raw
  (batch 1024; the same 64 KiB samples as a ``bytes`` field; in shards a sixteenth as large), run beside them
  for issue 40's ratios; images: JPEGs made
  at bench time, decoded and randomly cropped in the workers, batch 64 (``tools/bench_derived.py``,
  ``tools/bench_images.py``).
- peers: ``--nodes`` (4) simulated nodes as in nodes, ``placement="global"``, a RAM tier of 0.3 D
  each, 3 epochs; every node's peer server behind a metering slow link of its own
  (``--peer-bandwidth``, default 4 x ``--bandwidth``; ``--peer-latency``, 2 ms): store MB and peer
  MB per epoch and each node's wall against its bound, datacache with the peer tier on, off
  (``datacache+nopeers``), Streaming and LitData (``tools/bench_peers.py``; its own table). The
  ``shuffle`` report puts the quality of global placement (this scenario) beside node-sticky
  (the nodes scenario) when the run has them.

Equal terms: every system gets the same batch size, DataLoader workers and
``persistent_workers=True``, each through its documented loader (``tools/bench_systems.py``); the
workers start at the run's first ``iter(loader)``, inside the first measured epoch for every system
alike, or inside the fill epoch where there is one. Exceptions, per scenario (also printed in
``results.md``, from ``tools/bench_text.NOTES``): small: batch 256, no compute (every system);
raw: no compute; limited: ``streaming+tuned`` sets ``shuffle_block_size`` to the samples of C/2
instead of ``predownload``; the matched-quality variants run in cold, warm and shuffle only.

Shuffle quality, in every scenario beside wall and first-batch time: distinct classes per batch
over the same for a uniform random permutation, on class-sorted data (the samples are written in
id order; class = id x 100 // n: ``tools/bench_quality.py``). Matched quality (``--variants``
``matched``): ``streaming+match-datacache`` (py1e blocks of datacache's window of shards),
``datacache+match-streaming`` (window = every shard) and ``datacache+match-litdata`` (window 1, node_shuffle "never");
LitData has no knob that mixes across its chunks. ``datacache+dropin`` (warm only): the drop-in
line, ``torch.utils.data.DataLoader(StreamingDataset(url), batch_size=B)`` over samples, beside
the default ``datacache.DataLoader(ds, batch_size=B)``; ``datacache+torch`` (warm, small, raw):
``torch.utils.data.DataLoader(StreamingDataset(url, batch_size=B), batch_size=None)``, batched mode
without torchdata's StatefulDataLoader (the default's base class before 11bac14);
``datacache+window`` (cold, warm, shuffle): ``node_shuffle="window"``, the cold epoch through
the sliding window rather than the default's part mix; ``datacache+never`` (raw, raw-bytes, small,
small-1024): ``node_shuffle="never"``, the warm epoch in the sliding window's order, beside the
default's uniform shuffle; ``datacache+mds`` (cold, warm): datacache over the Streaming system's MDS
dataset of the same samples, indexed in place once by ``datacache index`` (``--systems datacache
--variants mds`` runs it beside the default alone). The mix scenario runs the default variants only.

CPU: every epoch records the CPU-seconds of the run's processes (the training process, every
DataLoader worker, any helper process a system starts: ``tools/bench_cpu.py``), reported as CPU
seconds per GB delivered beside wall and wait.

A failed or aborted repetition stays in ``results.jsonl`` with its cause; the tables print n
(repetitions completed of run) per cell and show a system none of whose repetitions completed as
failed, never as beaten. ``--readme README.md`` publishes the run: ``results.jsonl``, ``run.json``,
``results.md`` and the charts are copied to ``docs/bench`` beside the README, and the README's
headline table and ``docs/benchmarks.md``'s full block are rebuilt from them
(``python tools/bench_report.py docs/bench --readme README.md docs/benchmarks.md`` does the last
step alone, from the committed files).

Bounds, measured in the same run: link = needed bytes / bandwidth; compute = batches x step time;
memcpy = D bytes copied in RAM (numpy, best of 3). Output: ``DIR/results.jsonl`` (one line per
system, scenario, epoch, rep), ``DIR/run.json``, ``DIR/results.md``, ``DIR/bench_*.png``; ``--profile SCENARIO``
runs datacache once more under py-spy (all processes and threads; pyinstrument, main process
only, if py-spy is missing) and saves the report in ``DIR/profile-SCENARIO.*``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from datacache.config import parse_size  # noqa: E402
from tools import bench_cpu, bench_derived, bench_mix, bench_nodes, bench_peers, bench_report  # noqa: E402
from tools.bench_launch import Meter, launch, memcpy_rate  # noqa: E402
from tools.bench_quality import pooled  # noqa: E402
from tools.bench_text import describe_run  # noqa: E402
from tools.bench_write import ensure_datasets  # noqa: E402

SYSTEMS = ("datacache", "streaming", "litdata", "fsspec")
# "tuned": a peer's one documented speed setting; "match-*": tuned through its documented shuffle
# knobs to about the named system's shuffle quality (tools/bench_systems.py), run in MATCHED only;
# "dropin": datacache through a plain torch DataLoader over samples, run in DROPIN only; "torch":
# datacache's batched mode through a plain torch DataLoader (batch_size=None), run in TORCH only;
# "window": datacache with node_shuffle="window" (its cold epoch through the sliding window, not
# the default's part mix), run in MATCHED only; "never": node_shuffle="never" (bench_derived); "mds": datacache
# over Streaming's MDS dataset of the same samples, indexed in place by `datacache index` (issue 41), run in MDS only;
# "nopeers": datacache with no peer tier configured, run in the peers scenario only (its "before");
# "node-sticky" / "global": datacache on --nodes simulated nodes with that placement, in shuffle only
VARIANTS = {"datacache": ("default", "dropin", "torch", "match-streaming", "match-litdata", "window", "never",
                          "mds", "nopeers", "node-sticky", "global"),
            "streaming": ("default", "tuned", "match-datacache"), "litdata": ("default", "tuned"),
            "fsspec": ("default",)}
MATCHED = ("cold", "warm", "shuffle")
DROPIN = ("warm",)
TORCH = ("warm", "small", "raw")
MDS = ("cold", "warm")
SCENARIOS = ("cold", "warm", "limited", "ranks", "small", "raw", "throttle", "nodes", "shuffle",
             "mix", "peers") + bench_derived.SCENARIOS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (datasets persist in DIR/s3)")
    p.add_argument("--quick", action="store_true", help="160 MB (small: 20 MB), 1 rep: about 5 minutes")
    p.add_argument("--scenario", default=",".join(SCENARIOS))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--variants", default="default,tuned,matched,dropin,torch,window,placement,never,mds",
                   help="settings to run: default, tuned, matched (the match-* variants, in cold, warm, shuffle), "
                        "dropin (datacache over samples through torch's DataLoader, in warm), torch (datacache's "
                        "batched mode through torch's DataLoader, in warm, small, raw), window (datacache's cold epoch "
                        "through the sliding window, in cold, warm, shuffle), placement (datacache on --nodes "
                        "nodes, node-sticky and global placement, in shuffle), never (datacache with "
                        "node_shuffle='never', in raw, raw-bytes, small, small-1024), mds (datacache over Streaming's "
                        "MDS dataset, indexed in place, in cold, warm)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 1 with --quick)")
    p.add_argument("--size", help="dataset size (default 500MB; 160MB with --quick)")
    p.add_argument("--small-size", help="1 KiB-sample dataset size (default 100MB; 20MB with --quick)")
    p.add_argument("--sample-bytes", default="64KiB")
    p.add_argument("--small-sample-bytes", default="1KiB")
    p.add_argument("--shard-bytes", help="default 16MB")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--small-batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--nodes", type=int, default=4, help="simulated nodes in the nodes and peers scenarios")
    bench_peers.add_args(p)
    p.add_argument("--compute", type=float, default=0.02, help="simulated compute per batch, s")
    p.add_argument("--bandwidth", default="50MB", help="link bandwidth, bytes/s, shared by all connections")
    p.add_argument("--latency", type=float, default=0.02, help="per-request latency, s")
    p.add_argument("--storm", type=float, default=30.0, help="throttle scenario: seconds of 503 SlowDown")
    bench_derived.add_args(p)
    p.add_argument("--profile", metavar="SCENARIO", help="also run datacache under a profiler for SCENARIO")
    p.add_argument("--profiler", choices=("auto", "py-spy", "pyinstrument"), default="auto",
                   help="auto: py-spy if installed (every process and thread), else pyinstrument (main process)")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds before one run is killed")
    p.add_argument("--readme", metavar="README.md",
                   help="publish: copy results.jsonl, run.json, results.md and the charts to docs/bench beside "
                        "this README and regenerate its headline table and docs/benchmarks.md's benchmark block "
                        "(tools/bench_report.py --readme)")
    a = p.parse_args(argv)
    q = a.quick
    a.reps = a.reps or (1 if q else 3)
    # --quick keeps the 16 MB shards: Streaming needs cache_limit >= 4 shards, and its default
    # predownload (8 x batch samples per worker) must fit in C = D/2 as it does at full size, or the
    # quick run would measure a thrash that the full run does not have.
    a.size = parse_size(a.size or ("160MB" if q else "500MB"))
    a.small_size = parse_size(a.small_size or ("20MB" if q else "100MB"))
    a.shard_bytes = parse_size(a.shard_bytes or "16MB")
    a.sample_bytes, a.small_sample_bytes = parse_size(a.sample_bytes), parse_size(a.small_sample_bytes)
    a.bandwidth = float(parse_size(a.bandwidth))
    bench_derived.parse(a)
    a.peer_bandwidth = float(parse_size(a.peer_bandwidth)) if a.peer_bandwidth else None
    a.scenarios = [s for s in a.scenario.split(",") if s]
    a.system_list = [s for s in a.systems.split(",") if s]
    for s in a.scenarios:
        if s not in SCENARIOS:
            p.error(f"unknown scenario {s!r}; known: {', '.join(SCENARIOS)}")
    for s in a.system_list:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; known: {', '.join(SYSTEMS)}")
    return a


def scenario(name: str, a: argparse.Namespace) -> dict[str, Any]:
    small = name == "small"
    sc = {"name": name, "dataset": "small" if small else "main",
          "batch_size": a.small_batch_size if small else a.batch_size, "workers": a.workers, "compute": a.compute,
          "phases": ["measured"], "ranks": 1, "cache_bytes": None, "persistent_workers": True}
    if name in ("warm", "small", "raw"):
        sc["phases"] = ["fill", "measured"]
    if name in ("small", "raw"):
        sc["compute"] = 0.0
    if name == "limited":
        sc["phases"] = ["measured"] * 3
    if name == "ranks":
        sc["ranks"] = 2
    if name == "throttle":
        sc.update(storm=a.storm, storm_at=0.5)  # the storm begins once D/2 has crossed the link
    if name == "nodes":
        sc["phases"], sc["nodes"] = ["measured"] * 3, a.nodes
    if name == "shuffle":
        sc["phases"] = ["cold", "warm"]  # from an empty cache, then from the cache it filled
    if name == "mix":
        sc["phases"], sc["dataset"] = list(bench_mix.PHASES), "mix"
    if name == "peers":
        sc.update(bench_peers.scenario_fields(a))
    return sc


def runs_in(variant: str, scenario_name: str) -> bool:
    """Whether a variant runs in a scenario: match-* in MATCHED, dropin in DROPIN, torch in TORCH, the
    mix default only, nopeers in (and with the default only) the peers scenario."""
    if scenario_name == "peers" or variant == "nopeers":
        return scenario_name == "peers" and variant in ("default", "nopeers")
    if variant in bench_peers.PLACEMENTS:
        return scenario_name == "shuffle"
    if variant.startswith("match-") or variant == "window":
        return scenario_name in MATCHED
    if variant == "dropin":
        return scenario_name in DROPIN
    if variant == "torch":
        return scenario_name in TORCH
    if variant == "never":
        return bench_derived.runs_never(scenario_name)
    if variant == "mds":
        return scenario_name in MDS
    return scenario_name != "mix" or variant == "default"


def storm_watch(link: Any, sc: dict[str, Any], D: int) -> tuple[threading.Event, threading.Thread, list]:
    """For a scenario with a storm: a thread that throttles the link once ``storm_at`` x D bytes
    crossed it, then samples the link's bytes (seconds since the storm began, bytes) every 50 ms
    into the returned list; set the event to stop it."""
    done, timeline = threading.Event(), []

    def watch() -> None:
        while not done.wait(0.02):
            if link.snapshot()["bytes_down"] >= sc["storm_at"] * D:
                link.throttle(sc["storm"])
                began = time.monotonic()
                while not done.wait(0.05):
                    timeline.append((time.monotonic() - began, link.snapshot()["bytes_down"]))
                return
    t = threading.Thread(target=watch, name="bench-storm", daemon=True)
    if sc.get("storm"):
        t.start()
    return done, t, timeline


def storm_figures(link: Any, storm: float, timeline: list, bandwidth: float) -> dict[str, Any]:
    """Requests answered 503, the node's request rate after the storm's first 5 s, and how soon
    after the storm bytes flowed again and the link ran at 80 % of its rate (over 0.5 s)."""
    late = sum(t >= 5 for t in link.throttled_at)
    out: dict[str, Any] = {"storm": storm, "throttled_requests": len(link.throttled_at),
                           "late_requests_per_s": round(late / max(storm - 5, 1e-9), 3)}
    after = [(t, b) for t, b in timeline if t >= storm]
    if after:
        b0 = after[0][1]
        out["resumed_s"] = next((round(t - storm, 2) for t, b in after if b > b0), None)
        out["full_rate_s"] = next((round(t - storm, 2) for i, (t, b) in enumerate(after)
                                   for t2, b2 in after[i + 10:i + 11] if (b2 - b) >= 0.8 * bandwidth * (t2 - t)), None)
    return out


# ---------------------------------------------------------------- the runs
def run_one(a: argparse.Namespace, ctx: dict[str, Any], system: str, variant: str, sc: dict[str, Any], rep: int,
            profile: str | None = None) -> list[dict[str, Any]]:
    label = system if variant == "default" else f"{system}+{variant}"
    info = ctx["datasets"][f"{'streaming' if variant == 'mds' else system}/{sc['dataset']}"]
    if variant == "mds" and "bytes" in info:
        index_in_place(ctx["server"], info["url"], ctx.setdefault("indexed", set()))
    base = {"system": label, "family": system, "variant": variant, "scenario": sc["name"], "rep": rep}
    if "bytes" not in info:
        why = {"unavailable": info["unavailable"]} if "unavailable" in info else \
            {"error": f"writing the dataset: {info.get('error')}"}
        return [{**base, **why}]
    if sc.get("nodes", 1) > 1 and bench_nodes.unavailable(system):
        return [{**base, "unavailable": bench_nodes.unavailable(system)}]
    sc = bench_peers.placement_variant(sc, variant, a.nodes)  # a copy
    D = info["bytes"]
    shard_bytes = info.get("shard_bytes", a.shard_bytes)  # the dataset's own (raw-shards: smaller)
    dc_D = ctx["datasets"][f"datacache/{sc['dataset']}"].get("bytes", D)
    if sc["base"] == "limited":
        sc["cache_bytes"] = dc_D // 2  # the same budget C for every system
    if sc["name"] in ("nodes", "peers"):
        sc["cache_bytes"] = int(0.3 * dc_D)  # per node
    link = ctx["link"]
    cache_dir = f"/dev/shm/dcbench-{os.getpid()}-{ctx['counter']}"
    ctx["counter"] += 1
    opts = ctx["server"].storage_options(link.endpoint_url)
    spec = {"system": system, "variant": variant, "scenario": sc, "url": info["url"], "storage_options": opts,
            "litdata_options": {"endpoint_url": link.endpoint_url, "aws_access_key_id": opts["key"],
                                "aws_secret_access_key": opts["secret"], "region_name": "us-east-1"},
            "cache_dir": cache_dir, "ssd_dir": cache_dir.replace("/dev/shm", a.tmp, 1) + "-ssd",
            "meter_url": ctx["meter"].url,
            "samples_per_shard": max(1, shard_bytes // info["sample_bytes"]),
            "sample_bytes": info["sample_bytes"],
            "n": info["n"], "shards": ctx["datasets"][f"datacache/{sc['dataset']}"].get("files", 1),
            "max_epoch_bytes": 8 * D,
            "env": {"S3_ENDPOINT_URL": link.endpoint_url, "AWS_ACCESS_KEY_ID": opts["key"],
                    "AWS_SECRET_ACCESS_KEY": opts["secret"], "AWS_DEFAULT_REGION": "us-east-1"}}
    if "streams" in info:  # the mix scenario
        spec.update(bench_mix.spec_part(info))
    wrap = None
    if profile:
        spec["profile"] = profile
        local = os.path.join(os.path.dirname(sys.executable), "py-spy")
        spy = shutil.which("py-spy") or (local if os.path.exists(local) else None)
        if a.profiler == "py-spy" and spy is None:
            raise SystemExit("--profiler py-spy: py-spy is not installed (pip install py-spy)")
        if spy and a.profiler != "pyinstrument":
            wrap = [spy, "record", "--subprocesses", "--threads", "--rate", "200", "--format", "raw",
                    "-o", profile + ".pyspy.txt", "--"]
            spec["profile"] = None
    path = os.path.join(a.tmp, f"{sc['name']}-{label}-r{rep}")
    link.reset_counters()
    t0 = time.time()
    storm_done, storm, storm_timeline = storm_watch(link, sc, D)
    try:
        with bench_peers.around_run(sc, spec, ctx["meter"], system, variant):  # the peer links, if any
            res = launch("run", spec, path, timeout=a.run_timeout, ranks=sc["ranks"], wrap=wrap,
                         nodes=sc.get("nodes", 1))
    finally:
        storm_done.set()
        storm.join() if storm.is_alive() else None
        if link.throttling:  # a storm never outlives its run
            link.throttle(0)
        for k in range(sc.get("nodes", 1)):
            suffix = f"-node{k}" if sc.get("nodes", 1) > 1 else ""
            shutil.rmtree(cache_dir + suffix, ignore_errors=True)
            shutil.rmtree(spec["ssd_dir"] + suffix, ignore_errors=True)
            shutil.rmtree(f"{path}.node{k}.tmp", ignore_errors=True)
    run_bytes = link.snapshot()["bytes_down"]
    if "records" not in res:
        return [{**base, **({"unavailable": res["unavailable"]} if "unavailable" in res else {"error": res["error"]})}]
    common = {"D": D, "C": sc["cache_bytes"], "n": info["n"], "sample_bytes": info["sample_bytes"],
              "shard_bytes": shard_bytes, "batch_size": sc["batch_size"],
              "workers": sc["workers"], "persistent_workers": sc["persistent_workers"],
              "ranks": sc["ranks"], "bandwidth": a.bandwidth, "latency": a.latency, "memcpy_rate": ctx["memcpy_rate"],
              "run_remote_bytes": run_bytes, "run_seconds": time.time() - t0}
    if sc.get("storm"):
        common.update(storm_figures(link, sc["storm"], storm_timeline, a.bandwidth))
    if "streams" in info:
        common.update(bench_mix.record_part(info))
    if sc["name"] == "nodes":
        common.update(nodes=sc["nodes"], predicted_remote=_predicted_nodes(info, sc, ctx["server"].storage_options()))
    common.update(bench_peers.record_fields(sc, spec))
    out = []
    for r in res["records"]:
        rec = {**base, **common, **r}
        if "rank_own_walls" in res:
            rec["rank_own_walls"] = [w[r["epoch"]] for w in res["rank_own_walls"]]
            rec["rank_samples"] = [n[r["epoch"]] for n in res["rank_samples"]]
            rec["samples"] = sum(rec["rank_samples"])  # the node's
            rec["quality"] = pooled([q[r["epoch"]] for q in res["rank_quality"]])  # every rank's batches
            rec.update(bench_cpu.node_total([c[r["epoch"]] for c in res["rank_cpu"]]))  # a session counted once
        if sc.get("nodes", 1) > 1 and "rank_extra" in res:
            rec["rank_extra"] = [x[r["epoch"]] for x in res["rank_extra"]]
        out.append(rec)
    return bench_peers.finish(out) if sc.get("nodes", 1) > 1 else out


def index_in_place(server: Any, url: str, done: set[str]) -> None:
    """``datacache index URL --force`` over a dataset another library wrote, once per run of the bench
    (``done``: the URLs indexed so far), in a process of its own, against the server itself: setup
    traffic never crosses the link."""
    if url in done:
        return
    env = {**os.environ, "AWS_ENDPOINT_URL": server.endpoint_url, "AWS_ACCESS_KEY_ID": server.access_key,
           "AWS_SECRET_ACCESS_KEY": server.secret_key, "AWS_DEFAULT_REGION": "us-east-1"}
    subprocess.run([sys.executable, "-m", "datacache.cli", "index", url, "--force", "--quiet"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    done.add(url)


def _predicted_nodes(info: dict[str, Any], sc: dict[str, Any], opts: dict[str, Any]) -> list[int] | None:
    """The nodes scenario's remote bytes per epoch as ``tools/scale_model`` predicts them from the
    plan of datacache's dataset (its manifest), for datacache's layout."""
    from contextlib import closing

    from datacache import load_manifest, open_store
    from tools.scale_model import predict_bytes

    try:
        with closing(open_store(info["url"], opts)) as store:
            m = load_manifest(store)
    except Exception:  # noqa: BLE001 - a peer's format has no datacache manifest
        return None
    counts = np.array([s.samples for s in m.shards], dtype=np.int64)
    sizes = np.array([s.bytes for s in m.shards], dtype=np.int64)
    return predict_bytes(counts, sizes, nodes=sc["nodes"], ranks=1, workers=sc["workers"], cache=sc["cache_bytes"],
                         epochs=len(sc["phases"]))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from tools.s3server import SeaweedServer
    from tools.slowlink import SlowLink

    os.makedirs(a.out, exist_ok=True)
    a.tmp = os.path.join(os.path.abspath(a.out), "runs")
    os.makedirs(a.tmp, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    command = " ".join(["python", "tools/bench.py"] + (sys.argv[1:] if argv is None else list(argv)))
    scs = [bench_derived.scenario(scenario, s, a) for s in a.scenarios]
    chosen = a.variants.split(",")
    variants = [(s, v) for s in a.system_list for v in VARIANTS[s]
                if v in ("default", "nopeers") or v in chosen or (v.startswith("match-") and "matched" in chosen)
                or (v in bench_peers.PLACEMENTS and "placement" in chosen)]
    jsonl = os.path.join(a.out, "results.jsonl")
    open(jsonl, "w").close()
    records: list[dict[str, Any]] = []
    with ExitStack() as stack:
        print("starting SeaweedFS and the slow link ...", flush=True)
        server = stack.enter_context(SeaweedServer("bench", data_dir=os.path.join(a.out, "s3")))
        link = stack.enter_context(SlowLink("127.0.0.1", server.port, bandwidth=a.bandwidth, latency=a.latency))
        meter = Meter(link)
        stack.callback(meter.close)
        mds = {"streaming"} if ("datacache", "mds") in variants and any(runs_in("mds", sc["name"]) for sc in scs) \
            else set()  # datacache+mds reads Streaming's dataset
        systems = sorted({s for s, _ in variants} | {"datacache"} | mds, key=SYSTEMS.index)
        datasets = ensure_datasets(a, server, systems, sorted({sc["dataset"] for sc in scs}))
        rate = memcpy_rate(datasets.get("datacache/main", {}).get("bytes", a.size))
        ctx = {"server": server, "link": link, "meter": meter, "datasets": datasets, "counter": 0, "memcpy_rate": rate}
        print(f"memcpy: {rate / 1e9:.2f} GB/s; link {a.bandwidth / 1e6:.0f} MB/s + {a.latency * 1e3:.0f} ms/request",
              flush=True)
        for rep in range(a.reps):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for sc in scs:
                for system, variant in order:
                    if not runs_in(variant, sc["name"]):
                        continue
                    recs = run_one(a, ctx, system, variant, sc, rep)
                    records += recs
                    with open(jsonl, "a") as f:
                        f.writelines(json.dumps(r) + "\n" for r in recs)
                    print(bench_report.progress_line(recs), flush=True)
        if a.profile:
            sc = bench_derived.scenario(scenario, a.profile, a)
            base = os.path.join(os.path.abspath(a.out), f"profile-{a.profile}")
            recs = run_one(a, ctx, "datacache", "default", sc, rep=-1, profile=base)
            print("profile: " + bench_report.summarize_profile(base), flush=True)
    run = describe_run(vars(a), command)
    with open(os.path.join(a.out, "run.json"), "w") as f:
        json.dump(run, f, indent=1)
    text = bench_report.write_report(a.out, records, run=run)
    print("\n" + text)
    if a.readme:
        publish(a.out, a.readme)
    return 0


def publish(out: str, readme: str) -> None:
    """Copy the raw results and the report next to the README (docs/bench) and regenerate the
    generated blocks of the README and of docs/benchmarks.md beside it (where that file exists)."""
    docs = os.path.join(os.path.dirname(os.path.abspath(readme)), "docs")
    dest = os.path.join(docs, "bench")
    os.makedirs(dest, exist_ok=True)
    for name in sorted(os.listdir(out)):
        if name in ("results.jsonl", "run.json", "results.md") or (name.startswith("bench_") and name.endswith(".png")):
            shutil.copyfile(os.path.join(out, name), os.path.join(dest, name))
    pages = [readme] + [p for p in [os.path.join(docs, "benchmarks.md")] if os.path.exists(p)]
    bench_report.main([dest, "--readme", *pages])


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted: stopped every process the benchmark started", file=sys.stderr)
        sys.exit(130)
