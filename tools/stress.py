"""Load test of the node cache: processes x threads reading random keys through one NodeCache.

    python tools/stress.py [--procs 4] [--threads 8] [--seconds 60] [--keys 64] [--key-bytes 256KB]
                           [--ram-bytes BYTES] [--ssd-bytes BYTES] [--dir DIR] [--seed 0]

Every process opens the same cache directories (one node cache, as DataLoader workers and ranks
do); every thread picks random keys and ``get``s them with their size and hash. The budgets default
to a quarter (RAM) and a half (SSD) of the data, so entries are evicted, demoted and promoted all
the time. A miss calls a fetch that writes the key's deterministic bytes; every read is checked
byte for byte (through ``read()``, ``mmap`` or the pinned descriptor, in turn) while other
threads and processes churn the tiers. At the end the cache is opened alone: it must find nothing
to reconcile, stay within its budgets, and every entry left must verify.

Prints reads/s, bytes verified, fetches and errors (a tqdm progress bar goes to stderr); exits 1
if there was any error.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tqdm import tqdm  # noqa: E402

from datacache.cache.eviction import LRUPolicy  # noqa: E402
from datacache.cache.node import NodeCache  # noqa: E402
from datacache.config import CacheConfig, format_size, parse_size  # noqa: E402
from datacache.hashing import hash_bytes, hash_file  # noqa: E402

FORK = mp.get_context("fork")
READS, BYTES, FETCHES, ERRORS, RAM, SSD, PASS = range(7)  # slots of each process's counters


def key_bytes(key: str, size: int) -> bytes:
    """The key's content: the same in every process."""
    return random.Random(f"{key}/{size}").randbytes(size)


def _read(handle: Any, how: int) -> bytes:
    if how == 0:
        return handle.read()
    if how == 1:
        with handle.mmap() as m:
            return m[:]
    return os.pread(handle.fd, handle.size, 0)


def worker(cfg: dict[str, Any], keys: list[str], size: int, threads: int, seconds: float, seed: int,
           counters: Any, errors: Any, start: Any) -> None:
    """One process: ``threads`` threads doing checked random gets for ``seconds`` after ``start``."""
    expected = {k: key_bytes(k, size) for k in keys}
    hashes = {k: hash_bytes(v) for k, v in expected.items()}
    lock = threading.Lock()
    local = [0] * 7

    def bump(slot: int, n: int = 1) -> None:
        with lock:
            local[slot] += n

    def report(text: str) -> None:
        bump(ERRORS)
        try:
            errors.put_nowait(f"pid {os.getpid()}: {text}")
        except Exception:
            pass

    try:
        cache = NodeCache(CacheConfig(**cfg), policy=LRUPolicy())
    except BaseException:
        report(traceback.format_exc())
        start.wait()
        return

    def run(tid: int, deadline: float) -> None:
        rng = random.Random(seed * 1000 + tid)
        i = 0
        while time.monotonic() < deadline:
            key = rng.choice(keys)

            def fetch(path: str, key: str = key) -> None:
                bump(FETCHES)
                data = expected[key]
                with open(path, "r+b") as f:
                    half = len(data) // 2
                    f.write(data[:half])
                    f.write(data[half:])
            try:
                h = cache.get(key, fetch, size=size, hash=hashes[key])
                try:
                    data = _read(h, i % 3)
                    if data != expected[key]:
                        report(f"wrong bytes for {key} from the {h.tier} tier ({h.path})")
                    else:
                        bump(READS)
                        bump(BYTES, len(data))
                        bump({"ram": RAM, "ssd": SSD}.get(h.tier, PASS))
                    if rng.random() < 0.2:  # hold the pin a moment while others churn
                        time.sleep(0.001)
                finally:
                    h.release()
            except BaseException:
                report(traceback.format_exc())
            i += 1

    start.wait()
    deadline = time.monotonic() + seconds  # CLOCK_MONOTONIC: the same clock in every process
    ts = [threading.Thread(target=run, args=(t, deadline), name=f"stress-{t}") for t in range(threads)]
    for t in ts:
        t.start()
    while any(t.is_alive() for t in ts):
        for t in ts:
            t.join(0.2)
        with lock:
            snap = list(local)
        for slot, v in enumerate(snap):
            counters[slot] = v
    try:
        cache.close()
    except BaseException:
        report(traceback.format_exc())
    with lock:
        for slot, v in enumerate(local):
            counters[slot] = v


def final_check(cfg: dict[str, Any], budgets: dict[str, int]) -> tuple[list[str], dict[str, Any]]:
    """Open the cache alone: nothing to reconcile, within budgets, every entry verifies."""
    problems = []
    with NodeCache(CacheConfig(**cfg)) as cache:
        if cache.reconciled and any(cache.reconciled.values()):
            problems.append(f"reconciliation found leftovers after a clean run: {cache.reconciled}")
        stats = cache.stats()
        for tier, budget in budgets.items():
            if stats[f"used_{tier}"] > budget:
                problems.append(f"{tier} tier uses {stats[f'used_{tier}']} bytes, over its budget {budget}")
        for key, entry, tier, path in cache.entry_files():
            if hash_file(path) != entry.hash:
                problems.append(f"entry {key} in the {tier} tier does not verify ({path})")
    return problems, stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/stress.py", description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=4, help="processes (default: %(default)s)")
    p.add_argument("--threads", type=int, default=8, help="threads per process (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=60, help="duration (default: %(default)s)")
    p.add_argument("--keys", type=int, default=64, help="distinct keys (default: %(default)s)")
    p.add_argument("--key-bytes", default="256KB", help="bytes per key (default: %(default)s)")
    p.add_argument("--ram-bytes", default=None, help="RAM tier budget (default: a quarter of the data)")
    p.add_argument("--ssd-bytes", default=None, help="SSD tier budget (default: half of the data)")
    p.add_argument("--dir", default=None, help="cache directory (default: fresh temporary ones, removed after)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    size = parse_size(a.key_bytes)
    data = a.keys * size
    budgets = {"ram": parse_size(a.ram_bytes) if a.ram_bytes is not None else data // 4,
               "ssd": parse_size(a.ssd_bytes) if a.ssd_bytes is not None else data // 2}
    made: list[str] = []
    if a.dir:
        ram_dir, ssd_dir = os.path.join(a.dir, "ram"), os.path.join(a.dir, "ssd")
    else:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        made = [tempfile.mkdtemp(prefix="datacache-stress-", dir=shm), tempfile.mkdtemp(prefix="datacache-stress-")]
        ram_dir, ssd_dir = os.path.join(made[0], "ram"), os.path.join(made[1], "ssd")
    cfg = dict(ram_bytes=budgets["ram"], ssd_bytes=budgets["ssd"], ram_dir=ram_dir, ssd_dir=ssd_dir)
    keys = [f"stress/key-{i:05d}" for i in range(a.keys)]
    print(f"stress: {a.procs} processes x {a.threads} threads for {a.seconds:g} s; {a.keys} keys x "
          f"{format_size(size)} = {format_size(data)} through ram {format_size(budgets['ram'])} + ssd "
          f"{format_size(budgets['ssd'])}", flush=True)
    try:
        counters = [FORK.Array("q", 7, lock=False) for _ in range(a.procs)]
        errors = FORK.Queue()
        start = FORK.Barrier(a.procs + 1)
        procs = [FORK.Process(target=worker, args=(cfg, keys, size, a.threads, a.seconds, a.seed * 100 + i,
                                                   counters[i], errors, start), daemon=True) for i in range(a.procs)]
        for proc in procs:
            proc.start()
        start.wait(timeout=120)  # every process has opened the cache and built its expected bytes
        t0 = time.monotonic()

        def total(slot: int) -> int:
            return sum(c[slot] for c in counters)

        with tqdm(total=round(a.seconds), unit="s", file=sys.stderr, desc="stress", mininterval=0.5,
                  bar_format="{desc}: {bar} {n:.0f}/{total:.0f} s{postfix}") as bar:
            while any(p.is_alive() for p in procs):
                for proc in procs:
                    proc.join(0.5)
                el = time.monotonic() - t0
                bar.n = min(el, a.seconds)
                bar.set_postfix_str(f"{total(READS) / max(el, 1e-9):,.0f} reads/s, {total(FETCHES)} fetches, "
                                    f"{total(ERRORS)} errors")
        elapsed = time.monotonic() - t0
        messages = []
        while True:
            try:
                messages.append(errors.get(timeout=0.1))
            except Exception:
                break
        crashed = [f"process {p.pid} exited with {p.exitcode}" for p in procs if p.exitcode != 0]
        problems, stats = final_check(cfg, budgets)
        n_errors = total(ERRORS) + len(crashed) + len(problems)
        reads = total(READS)
        print(f"reads: {reads} ({reads / elapsed:,.0f} reads/s)  bytes verified: {total(BYTES)} "
              f"({format_size(total(BYTES))}, {format_size(total(BYTES) / elapsed)}/s)")
        print(f"fetches: {total(FETCHES)}  served from: ram {total(RAM)}, ssd {total(SSD)}, pass-through "
              f"{total(PASS)}  evictions: ram {stats['evictions_ram']}, ssd {stats['evictions_ssd']}  "
              f"demotions: {stats['demotions']}  promotions: {stats['promotions']}")
        print(f"errors: {n_errors}")
        for text in (messages + crashed + problems)[:5]:
            print(f"  {text.rstrip()}", file=sys.stderr)
        return 1 if n_errors else 0
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
