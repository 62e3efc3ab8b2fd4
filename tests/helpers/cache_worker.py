"""Helpers for tests/test_cache.py: code run inside child processes, and process plumbing.

Entry bytes and sizes are derived from the key alone, so any process can check what it reads.
Every call of a fetch function appends ``<key> <tag>`` to a per-process log file in ``log_dir``
(``O_APPEND``, one small write per line), so fetch counts survive even a SIGKILLed process.
"""
from __future__ import annotations

import functools
import hashlib
import multiprocessing as mp
import os
import random
import signal
import threading
import time
import traceback
from typing import Any

from datacache.cache.eviction import LRUPolicy
from datacache.cache.index import Index
from datacache.cache.node import NodeCache
from datacache.config import CacheConfig
from datacache.hashing import hash_bytes

KB = 1 << 10
FORK = mp.get_context("fork")


def key_size(key: str, lo: int = 64 * KB, hi: int = 256 * KB) -> int:
    """A size in [lo, hi] fixed by the key."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return lo + h % (hi - lo + 1)


@functools.lru_cache(maxsize=256)
def key_bytes(key: str, size: int) -> bytes:
    """Deterministic pseudo-random bytes for ``key`` (the same in every process)."""
    return random.Random(f"{key}/{size}").randbytes(size)


def key_hash(key: str, size: int) -> str:
    return hash_bytes(key_bytes(key, size))


def log_fetch(log_dir: str, key: str, tag: str = "") -> None:
    fd = os.open(os.path.join(log_dir, f"fetches-{os.getpid()}.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{key} {tag}\n".encode())
    finally:
        os.close(fd)


def read_fetch_log(log_dir: str) -> list[tuple[str, str]]:
    """Every logged fetch as ``(key, tag)``, over all processes."""
    out = []
    for name in sorted(os.listdir(log_dir)):
        if name.startswith("fetches-"):
            with open(os.path.join(log_dir, name)) as f:
                out += [tuple(line.rstrip("\n").split(" ", 1)) for line in f if line.strip()]
    return out


def make_fetch(key: str, size: int, log_dir: str, tag: str = "", *, chunk: int = 0, delay: float = 0.0,
               delay_after: float | None = None, mid_write: Any = None):
    """``fetch(path)`` writing ``key``'s bytes into ``path``; logs the call first.

    With ``chunk``, writes ``chunk`` bytes at a time sleeping ``delay`` between chunks, and calls
    ``mid_write()`` (e.g. an Event's ``set``) once a third of the bytes are written; after that it
    sleeps ``delay_after`` (default ``delay``) between chunks.
    """
    def fetch(path: str) -> None:
        log_fetch(log_dir, key, tag)
        data = key_bytes(key, size)
        pause, signal_mid = delay, mid_write
        with open(path, "r+b") as f:
            if not chunk:
                f.write(data)
                return
            for off in range(0, size, chunk):
                f.write(data[off:off + chunk])
                f.flush()
                if signal_mid is not None and off + chunk >= size // 3:
                    signal_mid()
                    signal_mid = None
                    pause = delay if delay_after is None else delay_after
                time.sleep(pause)
    return fetch


def get_checked(cache: NodeCache, key: str, log_dir: str, tag: str = "", size: int | None = None,
                use_mmap: bool = False, **fetch_kw: Any):
    """``cache.get`` with the key's fetch, size and hash; checks the bytes, returns the handle."""
    size = key_size(key) if size is None else size
    h = cache.get(key, make_fetch(key, size, log_dir, tag, **fetch_kw), size=size, hash=key_hash(key, size))
    if use_mmap:
        with h.mmap() as m:
            data = m[:]
    else:
        data = h.read()
    if data != key_bytes(key, size):
        h.release()
        raise AssertionError(f"wrong bytes for {key} from tier {h.tier} at {h.path}")
    return h


def stress_worker(cfg: dict, keys: list[str], n_threads: int, n_gets: int, seed: int, log_dir: str,
                  start: Any, results: Any) -> None:
    """One process of the stress test: ``n_threads`` threads doing ``n_gets`` random checked gets."""
    errors: list[str] = []
    per_thread: list[dict[str, int]] = [{} for _ in range(n_threads)]
    try:
        cache = NodeCache(CacheConfig(**cfg), policy=LRUPolicy())
        start.wait()

        def run(tid: int) -> None:
            rng = random.Random(seed * 1000 + tid)
            tiers = per_thread[tid]
            try:
                for i in range(n_gets):
                    key = rng.choice(keys)
                    h = get_checked(cache, key, log_dir, use_mmap=(i % 3 == 0))
                    tiers[h.tier] = tiers.get(h.tier, 0) + 1
                    if h.tier not in ("ram", "ssd", "pass"):
                        errors.append(f"bad tier {h.tier}")
                    if rng.random() < 0.3:  # hold a pin for a moment while others churn
                        time.sleep(0.001)
                    h.release()
            except BaseException:
                errors.append(traceback.format_exc())

        threads = [threading.Thread(target=run, args=(t,)) for t in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cache.close()
    except BaseException:
        errors.append(traceback.format_exc())
    tiers: dict[str, int] = {}
    for t in per_thread:
        for k, n in t.items():
            tiers[k] = tiers.get(k, 0) + n
    results.put((os.getpid(), errors, tiers))


def same_key_worker(cfg: dict, key: str, size: int, log_dir: str, barrier: Any, results: Any) -> None:
    """Wait on ``barrier`` so every process asks for the missing ``key`` at once (slow fetch)."""
    try:
        cache = NodeCache(CacheConfig(**cfg))
        barrier.wait()
        h = get_checked(cache, key, log_dir, size=size, chunk=size // 16, delay=0.02)
        tier = h.tier
        h.release()
        cache.close()
        results.put((os.getpid(), None, tier))
    except BaseException:
        results.put((os.getpid(), traceback.format_exc(), None))


def slow_fetcher(cfg: dict, key: str, size: int, log_dir: str, mid_write: Any) -> None:
    """Fetch ``key`` very slowly, calling ``mid_write.set()`` mid-way; meant to be SIGKILLed."""
    cache = NodeCache(CacheConfig(**cfg))
    get_checked(cache, key, log_dir, "killed", size=size, chunk=size // 200, delay=0.002, delay_after=0.1,
                mid_write=mid_write.set)
    os.kill(os.getpid(), signal.SIGKILL)  # never reached in the tests: the parent kills us first


def waiter(cfg: dict, key: str, size: int, log_dir: str, ready: Any, results: Any) -> None:
    """Ask for ``key`` (blocking on its lock while the slow fetcher holds it); report what came back."""
    try:
        cache = NodeCache(CacheConfig(**cfg))
        ready.set()
        h = get_checked(cache, key, log_dir, "waiter", size=size)
        out = (h.tier, h.path)
        h.release()
        stats = cache.stats()
        cache.close()
        results.put((None, out, stats))
    except BaseException:
        results.put((traceback.format_exc(), None, None))


# ------------------------------------------------------------------ test-process helpers
def join_all(procs, timeout=90):
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, f"{len(hung)} child processes hung (deadlock?)"


def in_child(fn, *args, timeout=60):
    """Run ``fn(*args)`` in a forked child; return its result (exceptions come back as text)."""
    q = FORK.Queue()

    def main():
        try:
            q.put((None, fn(*args)))
        except BaseException:
            q.put((traceback.format_exc(), None))

    p = FORK.Process(target=main, daemon=True)
    p.start()
    err, out = q.get(timeout=timeout)
    join_all([p], timeout)
    assert err is None, err
    assert p.exitcode == 0
    return out


def data_files(d) -> dict[str, int]:
    """name -> size of the plain files in ``d`` (empty if it does not exist)."""
    out = {}
    try:
        entries = list(os.scandir(d))
    except FileNotFoundError:
        return out
    for e in entries:
        try:
            if e.is_file(follow_symlinks=False):
                out[e.name] = e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass
    return out
    for e in entries:
        try:
            out[e.name] = e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass
    return out


class BudgetMonitor(threading.Thread):
    """Samples the bytes on disk in each tier and the index's committed ``used`` while children run."""

    def __init__(self, dirs, budgets: dict[str, int], allowance: int) -> None:
        super().__init__(daemon=True)
        self.dirs, self.budgets, self.allowance = dirs, budgets, allowance
        self.stop = threading.Event()
        self.samples = 0
        self.max_disk = {t: 0 for t in budgets}
        self.max_used = {t: 0 for t in budgets}
        self.violations: list[str] = []

    def run(self) -> None:
        index = Index(os.path.join(self.dirs["ssd"], "control"))
        try:
            while not self.stop.is_set():
                for tier, budget in self.budgets.items():
                    disk = sum(data_files(os.path.join(self.dirs[tier], "data")).values())
                    self.max_disk[tier] = max(self.max_disk[tier], disk)
                    if disk > budget + self.allowance:
                        self.violations.append(f"{tier}: {disk} bytes on disk > {budget} + {self.allowance}")
                with index.read() as txn:
                    used = {t: txn.used(t) for t in self.budgets}
                for tier, n in used.items():
                    self.max_used[tier] = max(self.max_used[tier], n)
                    if n > self.budgets[tier]:
                        self.violations.append(f"{tier}: committed used {n} > budget {self.budgets[tier]}")
                self.samples += 1
                time.sleep(0.002)
        finally:
            index.close()
