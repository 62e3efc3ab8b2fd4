"""CPU accounting of ``tools/bench.py``: the CPU-seconds a run's processes spent in an epoch, from the
kernel's own per-process accounting (``/proc/<pid>/stat``), for every system alike.

What is counted: the training process (the runner), every DataLoader worker, and any helper
process a system starts (a downloader process, a server): every process of the run's *scope*,
each with its user + system time (all its threads, live and exited) plus the time of its children
it has reaped (``cutime + cstime``). A process that exits during the epoch and is reaped by a
process of the scope moves its time into its parent's ``cutime``, so the sum is conserved: workers
that persist across epochs are counted while they live, workers that are reaped (non-persistent
ones, or all of them at the end) are counted through their parent. Only a process reaped by one
outside the scope (an orphan adopted by init) loses the time it spent after the last sample.

Scopes:

- ``"session"``: every process of the runner's session (``tools/bench_launch.launch`` starts each
  run as a session leader: torchrun, its ranks and their workers are one session; a simulated node
  is its own). The runner uses it when ``BENCH_CPU_SCOPE=session`` (set by ``launch``); ranks of one
  session then each see the whole session, and ``node_total`` counts a session once.
- ``"tree"``: the process and its descendants (by parent pid), for a runner started elsewhere
  (a test's own process, whose session holds unrelated processes).

``snapshot()`` is a pure read of /proc (Linux; elsewhere it returns None and the figures are left
out); thread-safe.
"""
from __future__ import annotations

import os
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, int, float, float] | None:
    """(ppid, session, own CPU s, reaped children's CPU s) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:  # exited (and reaped) between the listing and the read
        return None
    rest = text[text.rindex(b")") + 2:].split()  # the command name may hold spaces and parentheses
    ppid, session = int(rest[1]), int(rest[3])
    own = (int(rest[11]) + int(rest[12])) / _TICK
    reaped = (int(rest[13]) + int(rest[14])) / _TICK
    return ppid, session, own, reaped


def _all() -> dict[int, tuple[int, int, float, float]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


def scope() -> str:
    """The scope the runner counts in: "session" under ``tools/bench_launch.launch``, else "tree"."""
    return "session" if os.environ.get("BENCH_CPU_SCOPE") == "session" else "tree"


def snapshot(root: int | None = None, how: str | None = None) -> dict[str, Any] | None:
    """CPU-seconds so far of ``root``'s scope (default: this process, ``scope()``): ``cpu_s`` the
    whole scope, ``main_s`` the root process alone (its own time, not its reaped children's),
    ``procs`` the live processes counted, ``sid`` the session. None where /proc is missing."""
    if not os.path.isdir("/proc"):
        return None
    root = os.getpid() if root is None else root
    how = how or scope()
    procs = _all()
    if root not in procs:
        return None
    sid = procs[root][1]
    if how == "session":
        members = [p for p, st in procs.items() if st[1] == sid]
    else:
        children: dict[int, list[int]] = {}
        for p, st in procs.items():
            children.setdefault(st[0], []).append(p)
        members, todo = [], [root]
        while todo:
            p = todo.pop()
            members.append(p)
            todo.extend(children.get(p, ()))
    total = sum(procs[p][2] + procs[p][3] for p in members)
    return {"cpu_s": total, "main_s": procs[root][2], "procs": len(members), "sid": sid, "scope": how}


def delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """An epoch's figures from two snapshots: ``cpu_s`` (every process of the scope), ``cpu_main_s``
    (the training process alone), ``cpu_procs`` (processes counted at the end), ``cpu_sid``; {}
    when either is missing."""
    if not before or not after:
        return {}
    return {"cpu_s": round(after["cpu_s"] - before["cpu_s"], 3),
            "cpu_main_s": round(after["main_s"] - before["main_s"], 3), "cpu_procs": after["procs"],
            "cpu_sid": after["sid"], "cpu_scope": after["scope"]}


def node_total(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One epoch's CPU figures of a run of several rank processes (each rank's record): a session
    counted once (its ranks each saw all of it: the largest), sessions (simulated nodes) summed."""
    by_sid: dict[Any, dict[str, Any]] = {}
    for r in per_rank:
        if "cpu_s" not in r:
            return {}
        key = r["cpu_sid"] if r.get("cpu_scope") == "session" else id(r)
        if key not in by_sid or r["cpu_s"] > by_sid[key]["cpu_s"]:
            by_sid[key] = r
    return {"cpu_s": round(sum(r["cpu_s"] for r in by_sid.values()), 3),
            "cpu_main_s": round(sum(r["cpu_main_s"] for r in per_rank), 3),
            "cpu_procs": sum(r["cpu_procs"] for r in by_sid.values()), "cpu_scope": per_rank[0].get("cpu_scope")}


def per_gb(cpu_s: float, delivered_bytes: float) -> float:
    """CPU-seconds per GB (1e9 B) delivered."""
    return cpu_s / max(delivered_bytes, 1) * 1e9


__all__ = ["delta", "node_total", "per_gb", "scope", "snapshot"]
