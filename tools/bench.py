"""datacache against its peers on one emulated WAN link: ``python tools/bench.py --out DIR``.

    python tools/bench.py [--quick] [--scenario cold,warm,limited,ranks,small,raw,throttle] [--storm 30]
                          [--systems datacache,streaming,litdata,fsspec] [--reps 3] [--profile SCENARIO] --out DIR

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
  cache of 0.3 D, 3 epochs: remote bytes per epoch for all nodes together, against the bytes
  ``tools/scale_model.predict_bytes`` predicts from the plan (datacache's default node placement).

Bounds, measured in the same run: link = needed bytes / bandwidth; compute = batches x step time;
memcpy = D bytes copied in RAM (numpy, best of 3). Output: ``DIR/results.jsonl`` (one line per
system, scenario, epoch, rep), ``DIR/results.md``, ``DIR/bench_*.png``; ``--profile SCENARIO``
runs datacache once more under py-spy (all processes and threads; pyinstrument, main process
only, if py-spy is missing) and saves the report in ``DIR/profile-SCENARIO.*``.
"""
from __future__ import annotations

import argparse
import http.server
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
from tools import bench_report  # noqa: E402

SYSTEMS = ("datacache", "streaming", "litdata", "fsspec")
VARIANTS = {"datacache": ("default",), "streaming": ("default", "tuned"), "litdata": ("default", "tuned"),
            "fsspec": ("default",)}
SCENARIOS = ("cold", "warm", "limited", "ranks", "small", "raw", "throttle", "nodes")
RUNNER = os.path.join(ROOT, "tools", "bench_systems.py")
# A new tag when a system's written format changes, so DIR/s3 never serves a stale layout
# (datacache: incompressible blocks stored raw since the raw-block format).
FORMAT_TAGS = {"datacache": "datacache-rawblocks"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (datasets persist in DIR/s3)")
    p.add_argument("--quick", action="store_true", help="160 MB (small: 20 MB), 1 rep: about 5 minutes")
    p.add_argument("--scenario", default=",".join(SCENARIOS))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--variants", default="default,tuned", help="peer settings to run: default, tuned or both")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 1 with --quick)")
    p.add_argument("--size", help="dataset size (default 500MB; 160MB with --quick)")
    p.add_argument("--small-size", help="1 KiB-sample dataset size (default 100MB; 20MB with --quick)")
    p.add_argument("--sample-bytes", default="64KiB")
    p.add_argument("--small-sample-bytes", default="1KiB")
    p.add_argument("--shard-bytes", help="default 16MB")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--small-batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--nodes", type=int, default=4, help="simulated nodes in the nodes scenario")
    p.add_argument("--compute", type=float, default=0.02, help="simulated compute per batch, s")
    p.add_argument("--bandwidth", default="50MB", help="link bandwidth, bytes/s, shared by all connections")
    p.add_argument("--latency", type=float, default=0.02, help="per-request latency, s")
    p.add_argument("--storm", type=float, default=30.0, help="throttle scenario: seconds of 503 SlowDown")
    p.add_argument("--profile", metavar="SCENARIO", help="also run datacache under a profiler for SCENARIO")
    p.add_argument("--profiler", choices=("auto", "py-spy", "pyinstrument"), default="auto",
                   help="auto: py-spy if installed (every process and thread), else pyinstrument (main process)")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds before one run is killed")
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
          "phases": ["measured"], "ranks": 1, "cache_bytes": None}
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
    return sc


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


# ---------------------------------------------------------------- infrastructure
class Meter:
    """A loopback HTTP endpoint serving the link's counters to the runner processes."""

    def __init__(self, link: Any) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = json.dumps(link.snapshot()).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True, name="bench-meter").start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def memcpy_rate(nbytes: int) -> float:
    """Bytes/s of a numpy copy of an ``nbytes`` buffer in RAM, best of 3."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               LITDATA_DISABLE_VERSION_CHECK="1", AWS_EC2_METADATA_DISABLED="true", TQDM_DISABLE="1")
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(cmd: str, spec: dict[str, Any], path: str, timeout: float, ranks: int = 1,
           wrap: list[str] | None = None, nodes: int = 1) -> dict[str, Any]:
    """Run the runner on ``spec`` in a fresh process (torchrun for ranks > 1; ``nodes`` processes,
    one rank per simulated node, with the launcher variables set by hand); its JSON result."""
    spec = {**spec, "result": path}
    with open(path + ".spec.json", "w") as f:
        json.dump(spec, f)
    argv = [sys.executable, RUNNER, cmd, path + ".spec.json"]
    if ranks > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] + argv[1:]
    argv = (wrap or []) + argv
    env = _env()
    env.update(spec.get("env", {}))
    ranks = max(ranks, nodes)
    for p in [path] + [f"{path}.rank{r}" for r in range(ranks)]:
        if os.path.exists(p):
            os.unlink(p)
    port = str(_free_port())
    node_env = [{}] if nodes == 1 else [
        {"RANK": str(k), "WORLD_SIZE": str(nodes), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "BENCH_NODE": str(k),
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for k in range(nodes)]
    with open(path + ".log", "wb") as log:
        procs = [subprocess.Popen(argv, cwd=ROOT, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True) for extra in node_env]
        deadline, rc = time.monotonic() + timeout, 0
        for proc in procs:
            try:
                rc = rc or proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
                break
        for proc in procs:
            try:  # whatever the run left behind (DataLoader workers of an aborted run, a hung rank)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        if rc is None:
            return {"error": f"timed out after {timeout:.0f} s (log: {path}.log)"}
    outs = [path] if ranks == 1 else [f"{path}.rank{r}" for r in range(ranks)]
    if rc != 0 or not all(os.path.exists(p) for p in outs):
        with open(path + ".log", errors="replace") as f:
            tail = f.read()[-1500:]
        last = " | ".join(line.strip() for line in tail.strip().splitlines()[-3:])
        return {"error": f"exit status {rc}: {last[-300:]} (log: {path}.log)"}
    results = []
    for p in outs:
        with open(p) as f:
            results.append(json.load(f))
    if ranks > 1 and "records" in results[0]:
        results[0]["rank_own_walls"] = [[r["own_wall"] for r in res["records"]] for res in results]
        results[0]["rank_samples"] = [[r["samples"] for r in res["records"]] for res in results]
    return results[0]


# ---------------------------------------------------------------- datasets
def ensure_datasets(a: argparse.Namespace, server: Any, systems: list[str], datasets: list[str]) -> dict[str, Any]:
    """Write each needed (system format, dataset) once; returns {(system, dataset): info or unavailable}."""
    import s3fs

    opts = server.storage_options()
    fs = s3fs.S3FileSystem(key=opts["key"], secret=opts["secret"], client_kwargs=opts["client_kwargs"])
    out: dict[str, Any] = {}
    for ds in datasets:
        total, sb = (a.small_size, a.small_sample_bytes) if ds == "small" else (a.size, a.sample_bytes)
        n = total // sb
        for system in systems:
            fmt = "datacache" if system == "fsspec" else system
            key = f"{fmt}/{ds}"
            if key not in out:
                prefix = f"{server.bucket}/{FORMAT_TAGS.get(fmt, fmt)}-{n}x{sb}-{a.shard_bytes}"
                meta_path = f"{prefix}/bench-meta.json"
                if fs.exists(meta_path):
                    info = json.loads(fs.cat_file(meta_path))
                else:
                    print(f"writing {n} samples of {sb} B as {fmt} to s3://{prefix}/ ...", flush=True)
                    spec = {"system": fmt, "n": n, "sample_bytes": sb, "shard_bytes": a.shard_bytes,
                            "url": f"s3://{prefix}/", "storage_options": opts, "tmp": a.tmp}
                    info = launch("write", spec, os.path.join(a.tmp, f"write-{fmt}-{ds}"), timeout=1800)
                    if "bytes" in info:
                        info.update(n=n, sample_bytes=sb, url=f"s3://{prefix}/")
                        fs.pipe_file(meta_path, json.dumps(info).encode())
                out[key] = info
            out[f"{system}/{ds}"] = out[key]
    return out


# ---------------------------------------------------------------- the runs
def run_one(a: argparse.Namespace, ctx: dict[str, Any], system: str, variant: str, sc: dict[str, Any], rep: int,
            profile: str | None = None) -> list[dict[str, Any]]:
    label = system if variant == "default" else f"{system}+{variant}"
    info = ctx["datasets"][f"{system}/{sc['dataset']}"]
    base = {"system": label, "family": system, "variant": variant, "scenario": sc["name"], "rep": rep}
    if "bytes" not in info:
        why = {"unavailable": info["unavailable"]} if "unavailable" in info else \
            {"error": f"writing the dataset: {info.get('error')}"}
        return [{**base, **why}]
    sc = dict(sc)
    D = info["bytes"]
    dc_D = ctx["datasets"][f"datacache/{sc['dataset']}"].get("bytes", D)
    if sc["name"] == "limited":
        sc["cache_bytes"] = dc_D // 2  # the same budget C for every system
    if sc["name"] == "nodes":
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
            "samples_per_shard": max(1, a.shard_bytes // info["sample_bytes"]), "sample_bytes": info["sample_bytes"],
            "max_epoch_bytes": 8 * D,
            "env": {"S3_ENDPOINT_URL": link.endpoint_url, "AWS_ACCESS_KEY_ID": opts["key"],
                    "AWS_SECRET_ACCESS_KEY": opts["secret"], "AWS_DEFAULT_REGION": "us-east-1"}}
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
    run_bytes = link.snapshot()["bytes_down"]
    if "records" not in res:
        return [{**base, **({"unavailable": res["unavailable"]} if "unavailable" in res else {"error": res["error"]})}]
    common = {"D": D, "C": sc["cache_bytes"], "n": info["n"], "sample_bytes": info["sample_bytes"],
              "shard_bytes": a.shard_bytes, "batch_size": sc["batch_size"], "workers": sc["workers"],
              "ranks": sc["ranks"], "bandwidth": a.bandwidth, "latency": a.latency, "memcpy_rate": ctx["memcpy_rate"],
              "run_remote_bytes": run_bytes, "run_seconds": time.time() - t0}
    if sc.get("storm"):
        common.update(storm_figures(link, sc["storm"], storm_timeline, a.bandwidth))
    if sc["name"] == "nodes":
        common.update(nodes=sc["nodes"], predicted_remote=_predicted_nodes(info, sc, ctx["server"].storage_options()))
    out = []
    for r in res["records"]:
        rec = {**base, **common, **r}
        if "rank_own_walls" in res:
            rec["rank_own_walls"] = [w[r["epoch"]] for w in res["rank_own_walls"]]
            rec["rank_samples"] = [n[r["epoch"]] for n in res["rank_samples"]]
            rec["samples"] = sum(rec["rank_samples"])  # the node's
        out.append(rec)
    return out


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
    scs = [scenario(s, a) for s in a.scenarios]
    variants = [(s, v) for s in a.system_list for v in VARIANTS[s]
                if v == "default" or v in a.variants.split(",")]
    jsonl = os.path.join(a.out, "results.jsonl")
    open(jsonl, "w").close()
    records: list[dict[str, Any]] = []
    with ExitStack() as stack:
        print("starting SeaweedFS and the slow link ...", flush=True)
        server = stack.enter_context(SeaweedServer("bench", data_dir=os.path.join(a.out, "s3")))
        link = stack.enter_context(SlowLink("127.0.0.1", server.port, bandwidth=a.bandwidth, latency=a.latency))
        meter = Meter(link)
        stack.callback(meter.close)
        systems = sorted({s for s, _ in variants} | {"datacache"}, key=SYSTEMS.index)
        datasets = ensure_datasets(a, server, systems, sorted({sc["dataset"] for sc in scs}))
        rate = memcpy_rate(datasets.get("datacache/main", {}).get("bytes", a.size))
        ctx = {"server": server, "link": link, "meter": meter, "datasets": datasets, "counter": 0, "memcpy_rate": rate}
        print(f"memcpy: {rate / 1e9:.2f} GB/s; link {a.bandwidth / 1e6:.0f} MB/s + {a.latency * 1e3:.0f} ms/request",
              flush=True)
        for rep in range(a.reps):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for sc in scs:
                for system, variant in order:
                    recs = run_one(a, ctx, system, variant, sc, rep)
                    records += recs
                    with open(jsonl, "a") as f:
                        f.writelines(json.dumps(r) + "\n" for r in recs)
                    print(bench_report.progress_line(recs), flush=True)
        if a.profile:
            sc = scenario(a.profile, a)
            base = os.path.join(os.path.abspath(a.out), f"profile-{a.profile}")
            recs = run_one(a, ctx, "datacache", "default", sc, rep=-1, profile=base)
            print("profile: " + bench_report.summarize_profile(base), flush=True)
    table = bench_report.write_report(a.out, records, command=command, settings=vars(a))
    print("\n" + table)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted: stopped every process the benchmark started", file=sys.stderr)
        sys.exit(130)
