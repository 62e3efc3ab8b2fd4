"""A restart after a killed job (issue 37, point 1): a ``datacache.DataLoader`` with two workers is
killed during a cold epoch that fills partial copies (``datacache.cache.partial``), then restarted on the
same cache; the restart must read every sample exactly once with every byte right, and the
reconciliation it starts with must leave each partial copy's state and scratch file as one unit
(both or neither).

Real S3 server behind a SlowLink (so fills are in flight when the kill comes), real processes
(forked from the test, each job in a process group of its own, killed as a preempted node's are).
The kill points are random (seeded): once a random share of the epoch's bytes has come through
the link while a partial copy is being filled; a third of the kills are a Ctrl-C (SIGINT). The
test waits on the job's output, the cache's files, the link's byte count and the node lock, never
on sleeps.
"""
from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest

import datacache
from datacache import CacheConfig, StreamingDataset
from tests.helpers import faults as H

SIZE, N, SHARD = 1000, 320, 40_000  # 8 shards of 40 samples, 4 samples a dcz block
WRITER = {"block_bytes": 4 * 1024}
TRIES = 20


def _copies(cache: datacache.NodeCache) -> dict[str, list[str]]:
    """The key ids of the partial copies' states (in the lock dir) and scratch files (in the tiers)."""
    states = [n[:-5] for n in os.listdir(cache.lock_dir) if n.endswith(".part")]
    scratch = [n[5:].split(".")[0] for t in cache.tiers.values() for n in H.files(t.data_dir)
               if n.startswith(".tmp-") and n.endswith(".part")]
    return {"states": sorted(states), "scratch": sorted(scratch)}


def _job(url: str, opts: dict[str, Any], cache: dict[str, Any], out: int) -> None:
    """A training job (a forked child): the cache's start-up report and partial copies, then every
    batch's ids (and how many samples had wrong bytes) as JSON lines on ``out``, then the end;
    never returns."""
    os.setpgid(0, 0)  # the workers join this group: a kill of the group is a preempted node's
    code = 1
    try:
        try:
            ds = StreamingDataset(url, storage_options=opts, cache=CacheConfig(**cache))
            os.write(out, (json.dumps({"reconciled": ds.cache.reconciled, **_copies(ds.cache)}) + "\n").encode())
            for batch in datacache.DataLoader(ds, batch_size=8, num_workers=2):
                ids = [int(i) for i in batch["i"]]
                bad = sum(bytes(d) != H.payload(i, SIZE) for i, d in zip(ids, batch["data"]))
                os.write(out, (json.dumps({"ids": ids, "bad": bad}) + "\n").encode())
            os.write(out, b'{"end": true}\n')
            code = 0
        except KeyboardInterrupt:  # Ctrl-C: the loader's workers were shut down as the loop unwound
            os.write(out, b'{"interrupted": true}\n')
            code = 130
        except BaseException:  # reported to the test, with where it came from
            os.write(out, (json.dumps({"error": traceback.format_exc()}) + "\n").encode())
    finally:  # whatever a handler above raised: never back into pytest in a forked child
        os._exit(code)


def _scratch_files(cache: dict[str, Any]) -> list[str]:
    return [n for n in H.files(Path(cache["ram_dir"]) / "data") if n.endswith(".part")]


def _run(url: str, opts: dict[str, Any], cache: dict[str, Any], kill_when: Callable[[], bool] | None,
         sig: int = signal.SIGKILL) -> dict[str, Any]:
    """Run a job to its end, or send its process group ``sig`` once ``kill_when()`` holds while a
    partial copy is being filled (SIGINT: Ctrl-C, then SIGKILL once the job has stopped).
    Returns what it reported (``_job``), and ``killed``: whether the signal came before its epoch
    ended."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _job(url, opts, cache, w)
    os.close(w)
    got: dict[str, Any] = {"ids": [], "bad": 0, "killed": False}
    with os.fdopen(r) as lines:
        try:
            if kill_when is None:
                _read(lines, got, until_end=True)
            else:
                done = H.wait_for(lambda: (os.waitpid(pid, os.WNOHANG)[0] == pid
                                           or (kill_when() and _scratch_files(cache))),
                                  60, "the job to fill partial copies")
                got["killed"] = done is not True
                if got["killed"] and sig != signal.SIGKILL:
                    os.killpg(pid, sig)
                    H.wait_for(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, 60, "the job to stop after Ctrl-C")
        finally:
            try:
                os.killpg(pid, signal.SIGKILL)  # the workers too, at once (not their watchdog's 5 s later)
            except ProcessLookupError:
                pass
        _read(lines, got, until_end=False)  # to EOF: every process of the job is gone
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # reaped while waiting for the kill point
        pass
    H.wait_for(lambda: _alone(Path(cache["ssd_dir"]) / "control"), 60, "the job's processes to exit")
    return got


def _read(lines: Any, got: dict[str, Any], until_end: bool) -> None:
    """Add the job's lines to ``got``: to its end or error if ``until_end``, else to EOF."""
    for line in lines:
        msg = json.loads(line)
        if "ids" in msg:
            got["ids"] += msg["ids"]
            got["bad"] += msg["bad"]
        else:
            got.update(msg)
        if until_end and ("end" in msg or "error" in msg):
            return


def _alone(control: Path) -> bool:
    """Whether no process holds the cache (its node lock free): the job's are all gone."""
    fd = os.open(control / "node.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


@pytest.mark.timeout(240)
def test_a_restart_after_kills_at_random_points_of_partial_fills_reads_every_sample_once(
        s3_server: Any, make_s3_url: Any, slowlink: Any, tmp_path: Path) -> None:
    url = make_s3_url()
    total = sum(s.bytes for s in H.write(url, s3_server.storage_options(), N, SIZE, shard_bytes=SHARD,
                                         writer_options=WRITER).shards)
    link = slowlink(bandwidth=0)
    opts = s3_server.storage_options(link.endpoint_url)
    rng = random.Random(37)
    kills = 0
    for t in range(TRIES):
        cache = H.cache_kw(tmp_path / f"try{t}", ram="8MB")
        link.bandwidth = 300_000  # about 1 s for the epoch's bytes: the kill finds fills in flight
        at = link.snapshot()["bytes_down"] + rng.uniform(0.05, 0.9) * total
        sig = signal.SIGINT if t % 3 == 2 else signal.SIGKILL  # a third of the kills are a Ctrl-C
        killed = _run(url, opts, cache, lambda at=at: link.snapshot()["bytes_down"] >= at, sig)
        assert "error" not in killed and killed["bad"] == 0, (t, killed)
        assert killed.get("interrupted", False) == (sig == signal.SIGINT and killed["killed"]), (t, killed)
        kills += killed["killed"]
        left = len(_scratch_files(cache))
        link.bandwidth = 0
        got = _run(url, opts, cache, None)
        assert "error" not in got and got["bad"] == 0, (t, got)
        assert sorted(got["ids"]) == list(range(N)), (t, "not every sample exactly once")
        # reconciled as units: no state without its scratch file, nor a scratch file without its state
        assert got["states"] == got["scratch"], (t, left, got["reconciled"], got["states"], got["scratch"])
    assert kills >= TRIES - 2, f"only {kills} of {TRIES} jobs were killed mid-fill"
