"""Helpers for tests/test_faults.py, tests/test_disk_full.py and tests/test_hostile.py, and a
child-process entry point.

Sample ``i`` of a test dataset is ``{"i": i, "data": payload(i, size)}``: the payload is derived
from ``i`` alone, so any process can check every byte it is served.

``python -m tests.helpers.faults '<json spec>'`` (from the repository root) runs one
StreamingDataset epoch (no DataLoader workers) in a fresh process and prints one JSON line:
``ids`` (in the order served), ``bad`` (samples whose bytes are wrong), ``stats`` and
``reconciled`` (the cache's start-up report).
Warnings of the datacache loggers go to stderr. The spec holds ``url``, ``opts``, ``cache``
(CacheConfig keywords), ``n`` and ``size``, and optionally ``transfer`` and ``prefetch``.
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parents[2]

from datacache import CacheConfig, Manifest, write_dataset  # noqa: E402
from tests.helpers.cache_worker import data_files as files  # noqa: E402,F401  (shared with the cache tests)
from tests.helpers.cache_worker import in_child  # noqa: E402,F401  (one fork helper for all tests)

FORK = mp.get_context("fork")
COMMAND = [sys.executable, "-m", "tests.helpers.faults"]  # run from ROOT


def payload(i: int, size: int) -> bytes:
    return random.Random(i).randbytes(size)


def write(url: str, opts: dict[str, Any] | None, n: int, size: int, shard_bytes: int, **kw: Any) -> Manifest:
    samples = ({"i": i, "data": payload(i, size)} for i in range(n))
    return write_dataset(samples, url, shard_bytes=shard_bytes, storage_options=opts, progress=False, **kw)


def check(samples: Iterable[dict[str, Any]], size: int) -> tuple[list[int], int]:
    """(ids in the order served, number of samples whose payload is wrong)."""
    ids, bad = [], 0
    for s in samples:
        i = int(s["i"])
        ids.append(i)
        bad += bytes(s["data"]) != payload(i, size)
    return ids, bad


def assert_exactly_once(samples: Iterable[dict[str, Any]], n: int, size: int) -> list[int]:
    ids, bad = check(samples, size)
    assert bad == 0, f"{bad} samples with wrong bytes"
    assert sorted(ids) == list(range(n)), "not every sample exactly once"
    return ids


def cache_kw(base: Path | str, ram: int | str = "4MB", ssd: int | str = 0, **kw: Any) -> dict[str, Any]:
    return {"ram_bytes": ram, "ssd_bytes": ssd, "ram_dir": str(Path(base) / "ram"), "ssd_dir": str(Path(base) / "ssd"),
            **kw}


def fill_up(mnt: Path, leave: int) -> None:
    """Another program takes the file system's space, all but ``leave`` bytes."""
    st = os.statvfs(mnt)
    with open(mnt / "someone-elses-file", "wb") as f:
        f.truncate(0)
        f.write(bytes(max(0, st.f_bavail * st.f_frsize - leave)))


def warnings_with(caplog: Any, word: str) -> list[str]:
    """The warnings (or worse) that pytest's ``caplog`` captured whose message holds ``word``."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and word in r.getMessage()]


def cache_config(base: Path | str, ram: int | str = "4MB", ssd: int | str = 0, **kw: Any) -> CacheConfig:
    return CacheConfig(**cache_kw(base, ram, ssd, **kw))


def leftovers(*dirs: str | Path) -> list[str]:
    return [n for d in dirs for n in files(d) if n.startswith((".tmp-", ".pass-"))]


def tree(root: str | Path) -> dict[str, tuple[int, int]]:
    """relative path -> (size, mtime_ns) of everything under ``root`` (links not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def stop(pid: int, timeout: float = 30) -> None:
    """SIGSTOP process ``pid`` and return once every thread of it is stopped (``/proc``), so that
    what a test sees of its files then is what a SIGKILL would leave."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        return all(s in "Tt" for s in states)
    wait_for(stopped, timeout, f"process {pid} to stop")


def epoch_json(spec: dict[str, Any]) -> dict[str, Any]:
    """One epoch in this process as described by ``spec`` (see the module docstring)."""
    from datacache import PrefetchConfig, StreamingDataset, TransferConfig

    ds = StreamingDataset(spec["url"], storage_options=spec.get("opts"), cache=CacheConfig(**spec["cache"]),
                          transfer=TransferConfig(**spec["transfer"]) if spec.get("transfer") else None,
                          prefetch=PrefetchConfig(**spec["prefetch"]) if spec.get("prefetch") else None,
                          node_shuffle=spec.get("node_shuffle", "auto"))
    try:
        ids, bad = check(ds, spec["size"])
        return {"ids": ids, "bad": bad, "stats": ds.stats(), "reconciled": ds.cache.reconciled}
    finally:
        ds.close()
        ds.cache.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    print(json.dumps(epoch_json(json.loads(sys.argv[1]))), flush=True)
