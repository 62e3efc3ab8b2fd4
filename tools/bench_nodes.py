"""The simulated nodes of ``tools/bench.py --scenario nodes``: how each node process is launched
and how each system is told that it runs on several nodes.

A simulated node is one rank process (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``
set as a launcher sets them, ``LOCAL_WORLD_SIZE=1``) with its DataLoader workers. Separate hosts
do not share ``/dev/shm`` or the temp directory, and MosaicML Streaming relies on that: every local
leader calls ``clean_stale_shared_memory()`` (it unlinks every Streaming segment in ``/dev/shm``)
and picks its shared-memory prefix as the first ``NNNNNN_locals`` segment that does not exist yet
(``streaming/base/shared/prefix.py``), so four leaders on one ``/dev/shm`` delete each other's
segments or create the same one (``FileNotFoundError: [Errno 2] No such file or directory:
'/000000_locals'``). Each node therefore runs in its own mount namespace with a private tmpfs on
``/dev/shm`` (``unshare --mount``, root or user namespaces needed) and its own ``TMPDIR`` (Streaming's
file locks live in ``tempfile.gettempdir()``), for every system alike. Where the namespace cannot
be made, the nodes share ``/dev/shm`` and Streaming is reported unavailable with that reason.

Multi-node settings, as each system documents them:

- datacache: none; the node count is ``WORLD_SIZE / LOCAL_WORLD_SIZE`` and the plan is node-sticky.
- streaming: ``num_canonical_nodes`` = the node count (the shard-to-node map of the run); a
  ``local`` cache directory per node (the runner's per-node cache dir).
- litdata: ``max_cache_size`` = C and a ``cache_dir`` per node (the runner's); its node split
  (``litdata.utilities.env._DistributedEnv.detect``) counts nodes as ``world_size //
  torch.cuda.device_count()`` and otherwise (CPU) as 1, unless ``NNODES`` is set: each node process
  gets ``NNODES`` = the node count, so later epochs stay within a node's chunks.

Functions are pure or touch only the given run directory; safe to call from any thread.
"""
from __future__ import annotations

import functools
import os
import subprocess
from typing import Any

# The command that gives the process it execs a private /dev/shm (a new mount namespace with a tmpfs).
_UNSHARE = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            'mount -t tmpfs -o mode=1777 dcbench-node /dev/shm && exec "$@"', "bench-node"]


@functools.lru_cache(maxsize=1)
def isolation() -> tuple[list[str] | None, str]:
    """(argv prefix that runs a command with a private ``/dev/shm``, "") or (None, why not)."""
    try:
        r = subprocess.run(_UNSHARE + ["true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"unshare --mount: {exc}"
    if r.returncode != 0:
        return None, f"unshare --mount: {(r.stderr or r.stdout).strip()[-200:]} (exit status {r.returncode})"
    return list(_UNSHARE), ""


def node_processes(argv: list[str], nodes: int, port: int, path: str) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, extra environment) for each simulated node's process of the run at ``path``."""
    wrap, _ = isolation()
    out = []
    for k in range(nodes):
        tmp = f"{path}.node{k}.tmp"
        os.makedirs(tmp, exist_ok=True)
        env = {"RANK": str(k), "WORLD_SIZE": str(nodes), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "BENCH_NODE": str(k), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TMPDIR": tmp,
               "NNODES": str(nodes), "BENCH_NODE_SHM": "private" if wrap else "shared"}
        out.append(((wrap or []) + _own_output(argv, k), env))
    return out


def _own_output(argv: list[str], k: int) -> list[str]:
    """``argv`` with a profiler's ``-o FILE`` (py-spy, see ``tools/bench.py --profile``) made
    ``FILE.node<k>``, so the nodes do not write one file; ``merge_outputs`` joins them after."""
    if "-o" not in argv[:-1]:
        return argv
    i = argv.index("-o") + 1
    return argv[:i] + [f"{argv[i]}.node{k}"] + argv[i + 1:]


def merge_outputs(argv: list[str], nodes: int) -> None:
    """Concatenate the nodes' ``FILE.node<k>`` profiler outputs (py-spy's raw format: one stack and
    its count a line, so the sum is a concatenation) into ``FILE``."""
    if "-o" not in argv[:-1]:
        return
    path = argv[argv.index("-o") + 1]
    with open(path, "w") as out:
        for k in range(nodes):
            if os.path.exists(f"{path}.node{k}"):
                with open(f"{path}.node{k}") as f:
                    out.write(f.read())
                os.unlink(f"{path}.node{k}")


def unavailable(system: str) -> str | None:
    """Why ``system`` cannot run several nodes on this machine, or None."""
    wrap, why = isolation()
    if system == "streaming" and wrap is None:
        return ("several Streaming nodes cannot share one /dev/shm (each local leader's "
                "clean_stale_shared_memory() unlinks the others' segments and all pick the same prefix: "
                f"FileNotFoundError: [Errno 2] No such file or directory: '/000000_locals'); {why}")
    return None


def loader_kwargs(system: str, sc: dict[str, Any]) -> dict[str, Any]:
    """The multi-node constructor arguments of ``system``'s dataset for scenario ``sc``."""
    nodes = int(sc.get("nodes", 1))
    if nodes > 1 and system == "streaming":
        return {"num_canonical_nodes": nodes}
    return {}


# ---------------------------------------------------------------- the nodes table of the report
def _cold(recs: list[dict[str, Any]]) -> dict[str, float]:
    """The cold (first) epoch of one run: its link bound (the bytes all nodes pulled over the one
    shared link / bandwidth), the slowest and fastest node's own wall over that bound, and when the
    link carried its first byte (seconds after the epoch began; from node 0's link samples)."""
    r = recs[0]
    bound = r["remote_bytes"] / r["bandwidth"]
    walls = r.get("rank_own_walls") or [r["own_wall"]]
    first = next((t for t, b in r.get("link_timeline", []) if b > 0), float("nan"))
    return {"bound": bound, "worst": max(walls) / bound, "best": min(walls) / bound, "first_byte": first}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def report(records: list[dict[str, Any]]) -> str:
    """The nodes scenario as a markdown table (medians over reps): remote MB and wall s per epoch
    for every system side by side, and each node's cold epoch against its link bound; "" without
    nodes records."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for r in records:
        if r.get("scenario") == "nodes" and r.get("rep", 0) >= 0:
            runs.setdefault(r["system"], {}).setdefault(r["rep"], []).append(r)
    if not runs:
        return ""
    rows = ["| system | remote MB per epoch | wall s per epoch | cold epoch: link bound s | each node's cold wall "
            "/ bound (best-worst) | link idle at start s |", "|---|---|---|---|---|---|"]
    for system, reps in runs.items():
        ok = [sorted(rs, key=lambda r: r["epoch"]) for rs in reps.values() if "wall" in rs[0] and
              not any("aborted" in r for r in rs)]
        if not ok:
            r0 = next(iter(reps.values()))[0]
            why = r0.get("unavailable") or r0.get("error") or next(
                (r["aborted"] for rs in reps.values() for r in rs if "aborted" in r), "no result")
            rows.append(f"| {system} | {' '.join(str(why).split())} | | | | |")
            continue
        n = min(len(rs) for rs in ok)
        mb = " / ".join(f"{_median([rs[e]['remote_bytes'] for rs in ok]) / 1e6:.1f}" for e in range(n))
        wall = " / ".join(f"{_median([rs[e]['wall'] for rs in ok]):.1f}" for e in range(n))
        cold = [_cold(rs) for rs in ok]
        rows.append(f"| {system} | {mb} | {wall} | {_median([c['bound'] for c in cold]):.2f} | "
                    f"{_median([c['best'] for c in cold]):.2f}-{_median([c['worst'] for c in cold]):.2f} | "
                    f"{_median([c['first_byte'] for c in cold]):.2f} |")
    r = next(r for reps in runs.values() for rs in reps.values() for r in rs)
    head = (f"### nodes: {r.get('nodes', '?')} simulated nodes, each with a cache of C = 0.3 D, all behind the one "
            "link (bytes metered at the proxy, all nodes together; wall: until the last node is done)\n")
    return head + "\n" + "\n".join(rows) + "\n"
