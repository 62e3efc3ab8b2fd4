"""The processes of ``tools/bench.py``: the link's meter, the memcpy bound, and ``launch``, which
runs ``tools/bench_systems.py`` on one spec in fresh processes (torchrun for ranks, one process
per simulated node) and collects its JSON result. ``launch`` is called from one thread at a time.
"""
from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from tools import bench_nodes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tools", "bench_systems.py")


class Meter:
    """A loopback HTTP endpoint serving the link's counters to the runner processes; with ``extra``
    set (a callable, e.g. the peers scenario's links: ``tools/bench_peers.py``), its counters too."""

    def __init__(self, link: Any) -> None:
        self.extra: Any = None
        meter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                extra = meter.extra
                body = json.dumps({**link.snapshot(), **(extra() if extra is not None else {})}).encode()
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

# the per-epoch fields every rank of a simulated node reports (tools/bench_peers.py joins them)
RANK_KEYS = ("ids_bits", "peer_stats")


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
               LITDATA_DISABLE_VERSION_CHECK="1", AWS_EC2_METADATA_DISABLED="true", TQDM_DISABLE="1",
               BENCH_CPU_SCOPE="session")  # each run is a session of its own (start_new_session): tools/bench_cpu.py
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cause(log_tail: str) -> str:
    """The last exception line of a log (``pkg.SomeError: message``), else its last 3 lines."""
    lines = [line.strip() for line in log_tail.strip().splitlines()]
    exc = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit|Timeout)\b.*:", line)]
    return exc[-1][:300] if exc else " | ".join(lines[-3:])[-300:]


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
    runs = [(argv, {})] if nodes == 1 else bench_nodes.node_processes(argv, nodes, _free_port(), path)
    with open(path + ".log", "wb") as log:
        procs = [subprocess.Popen(cmd, cwd=ROOT, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True) for cmd, extra in runs]
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
        if nodes > 1:
            bench_nodes.merge_outputs(argv, nodes)
        if rc is None:
            return {"error": f"timed out after {timeout:.0f} s (log: {path}.log)"}
    outs = [path] if ranks == 1 else [f"{path}.rank{r}" for r in range(ranks)]
    if rc != 0 or not all(os.path.exists(p) for p in outs):
        with open(path + ".log", errors="replace") as f:
            tail = f.read()[-6000:]
        return {"error": f"exit status {rc}: {cause(tail)} (log: {path}.log)"}
    results = []
    for p in outs:
        with open(p) as f:
            results.append(json.load(f))
    if ranks > 1 and "records" in results[0]:
        results[0]["rank_own_walls"] = [[r["own_wall"] for r in res["records"]] for res in results]
        results[0]["rank_samples"] = [[r["samples"] for r in res["records"]] for res in results]
        results[0]["rank_cpu"] = [[{k: v for k, v in r.items() if k.startswith("cpu_")} for r in res["records"]]
                                  for res in results]
        results[0]["rank_quality"] = [[(r.get("distinct_sum", 0), r.get("expected_sum", 0)) for r in res["records"]]
                                      for res in results]
        results[0]["rank_extra"] = [[{k: r[k] for k in RANK_KEYS if k in r} for r in res["records"]] for res in results]
    return results[0]
