"""Real multi-node jobs on one machine (tests/test_multinode.py, tests/test_peers_nodes.py): every
"node" is a set of rank processes (``tests/helpers/node_worker.py``) started with the launcher
variables set by hand (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), each node with its own RAM
and SSD directories. ``Job`` starts them and steps them through their epochs; ``exactly_once``
checks an epoch's sample ids across every rank. Used from the test's thread only."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["Job", "exactly_once", "TIMEOUT"]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "node_worker.py"
TIMEOUT = 300
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Job:
    """``nodes`` x ``per_node`` rank processes of one run; ``step(epoch)`` waits for every rank to
    finish the epoch and returns the proxy's counters at that point, then lets the ranks go on."""

    def __init__(self, tmp: Path, name: str, link: Any, base: dict[str, Any], node_dirs: list[Path],
                 per_node: int, epochs: list[int], **extra: Any) -> None:
        self.out, self.link, self.epochs = tmp / name, link, epochs
        self.out.mkdir()
        self.world = len(node_dirs) * per_node
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
        env.update(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        for rank in range(self.world):
            node = node_dirs[rank // per_node]
            cfg = {**base, **extra, "epochs": epochs, "out_dir": str(self.out), "ram_dir": str(node / "ram"),
                   "ssd_dir": str(node / "ssd")}
            path = self.out / f"cfg{rank}.json"
            path.write_text(json.dumps(cfg))
            launch = {"RANK": str(rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(rank % per_node),
                      "LOCAL_WORLD_SIZE": str(per_node)}
            log = self.out / f"rank{rank}.log"
            self.logs.append(log)
            with open(log, "wb") as f:
                self.procs.append(subprocess.Popen([sys.executable, str(WORKER), str(path)], cwd=ROOT,
                                                   env={**env, **launch}, stdout=f, stderr=subprocess.STDOUT,
                                                   start_new_session=True))
        self.deadline = time.monotonic() + TIMEOUT
        self.killed: set[int] = set()  # ranks the test killed

    def fallbacks(self) -> str:
        """The ranks' log lines saying why a peer fetch fell back (``datacache.peer`` at INFO)."""
        return "\n".join(f"rank {r}: {line}" for r, p in enumerate(self.logs)
                         for line in p.read_text(errors="replace").splitlines() if "did not deliver" in line)

    def _tail(self) -> str:
        return "\n".join(f"--- rank {r}\n{p.read_text(errors='replace')[-3000:]}" for r, p in enumerate(self.logs))

    def _stuck(self, what: str) -> str:
        """``what``, and every live rank's stacks (its processes' threads, ``node_worker``'s SIGUSR1)."""
        for r, p in enumerate(self.procs):
            if r not in self.killed and p.poll() is None:
                os.killpg(p.pid, signal.SIGUSR1)
        time.sleep(1.0)  # the dumps are written by the signal handlers; nothing to wait on
        return f"{what}:\n" + "\n".join(f"--- rank {r}\n{p.read_text(errors='replace')[-12000:]}"
                                         for r, p in enumerate(self.logs))

    def step(self, epoch: int) -> dict[str, int]:
        want = [self.out / f"{what}{epoch}_rank{r}.json" for r in range(self.world) if r not in self.killed
                for what in ("epoch", "stats")]
        while not all(p.exists() for p in want):
            for r, p in enumerate(self.procs):
                assert r in self.killed or p.poll() is None, f"rank {r} exited early ({p.returncode}):\n{self._tail()}"
            if time.monotonic() >= self.deadline:
                raise AssertionError(self._stuck(f"epoch {epoch} did not finish"))
            time.sleep(0.05)
        snap = self.link.snapshot()
        (self.out / f"go{epoch}").touch()
        return snap

    def ids(self, epoch: int) -> list[list[int]]:
        return [json.loads((self.out / f"epoch{epoch}_rank{r}.json").read_text()) for r in range(self.world)]

    def stats(self, epoch: int, rank: int) -> dict[str, Any]:
        return json.loads((self.out / f"stats{epoch}_rank{rank}.json").read_text())

    def finish(self) -> None:
        """Let ranks started with ``linger`` exit (the ``exit`` file), and wait for them to exit cleanly."""
        (self.out / "exit").touch()
        try:
            for r, p in enumerate(self.procs):
                rc = p.wait(timeout=max(1.0, self.deadline - time.monotonic()))
                assert rc == 0 or r in self.killed, f"rank {r} failed ({rc}):\n{self._tail()}"
        finally:
            self.kill()

    def wait_for(self, name: str) -> None:
        """Wait until every live rank wrote ``<name>_rank<r>`` in the job's directory."""
        want = [self.out / f"{name}_rank{r}" for r in range(self.world) if r not in self.killed]
        while not all(p.exists() for p in want):
            assert all(r in self.killed or p.poll() is None for r, p in enumerate(self.procs)), self._tail()
            if time.monotonic() >= self.deadline:
                raise AssertionError(self._stuck(f"no {name} from every rank"))
            time.sleep(0.05)

    def kill_node(self, node: int, per_node: int = 1) -> None:
        """SIGKILL every process of node ``node`` (its ranks' sessions: their DataLoader workers too)."""
        for r in range(node * per_node, (node + 1) * per_node):
            self.killed.add(r)
            p = self.procs[r]
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()

    def run(self) -> list[dict[str, int]]:
        """Every epoch's counters (cumulative), then wait for the ranks to exit cleanly."""
        try:
            snaps = [self.step(e) for e in self.epochs]
            for r, p in enumerate(self.procs):
                rc = p.wait(timeout=max(1.0, self.deadline - time.monotonic()))
                assert rc == 0, f"rank {r} failed ({rc}):\n{self._tail()}"
            return snaps
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)  # the rank's own session: it and its DataLoader workers
                p.wait()


def exactly_once(per_rank: list[list[int]], n: int) -> None:
    seen = Counter(i for ids in per_rank for i in ids)
    assert set(seen) == set(range(n)), f"{n - len(set(seen) & set(range(n)))} samples never read"
    repeats = sum(c - 1 for c in seen.values())
    assert repeats < len(per_rank), f"{repeats} repeats beyond the padding"
    assert len({len(ids) for ids in per_rank}) == 1, "ranks read different amounts"
