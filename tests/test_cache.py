"""NodeCache acceptance tests: real processes (fork), real directories, no mocks.

The RAM tier lives under /dev/shm when it exists (as in production: fsync is free there), the SSD
tier under pytest's tmp_path. Children are forked, so they inherit the imported modules; results
come back over multiprocessing queues and per-process fetch logs (see ``tests.helpers.cache_worker``).
Multi-process tests carry a timeout mark: a deadlock fails instead of hanging.
"""
from __future__ import annotations

import fcntl
import logging
import multiprocessing as mp
import os
import shutil
import signal
import stat
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datacache._localfs import key_id
from datacache.cache.eviction import ClairvoyantPolicy, LRUPolicy, Schedule
from datacache.cache.index import Index
from datacache.cache.node import NodeCache
from datacache.config import CacheConfig
from datacache.errors import CacheError
from tests.helpers import cache_worker as W
from tests.helpers.as_user import give_away
from tests.helpers.faults import wait_for

CTX = mp.get_context("fork")
KB, MB = 1 << 10, 1 << 20
SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.fixture
def fast_dir(tmp_path):
    """A scratch directory on tmpfs when there is one (cheap fsync), else under tmp_path."""
    d = tempfile.mkdtemp(prefix="dc-test-", dir=SHM) if SHM else str(tmp_path / "fast")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def dirs(tmp_path, fast_dir):
    log = tmp_path / "log"
    log.mkdir()
    return {"ram": str(fast_dir / "ram"), "ssd": str(tmp_path / "ssd"), "log": str(log)}


def cfg(dirs, ram, ssd, **kw):
    return dict(ram_bytes=ram, ssd_bytes=ssd, ram_dir=dirs["ram"], ssd_dir=dirs["ssd"], **kw)


def open_cache(dirs, ram, ssd, policy=None, **kw) -> NodeCache:
    return NodeCache(CacheConfig(**cfg(dirs, ram, ssd, **kw)), policy=policy)


def leftovers(*dirs_: str) -> list[str]:
    return [n for d in dirs_ for n in W.data_files(d) if n.startswith((".tmp-", ".pass-"))]


def ram_data(dirs):
    return os.path.join(dirs["ram"], "data")


def ssd_data(dirs):
    return os.path.join(dirs["ssd"], "data")


def fetch_counts(dirs, tag=None) -> Counter:
    return Counter(k for k, t in W.read_fetch_log(dirs["log"]) if tag is None or t == tag)


# --------------------------------------------------------------------------- 1. stress
def run_stress(dirs, ram, ssd, *, procs=4, threads=4, gets=100, nkeys=40):
    keys = [f"shard-{i:03d}" for i in range(nkeys)]
    c = cfg(dirs, ram, ssd)
    start = CTX.Barrier(procs + 1)
    results = CTX.Queue()
    ps = [CTX.Process(target=W.stress_worker, args=(c, keys, threads, gets, seed, dirs["log"], start, results),
                      daemon=True) for seed in range(procs)]
    for p in ps:
        p.start()
    start.wait(timeout=60)  # every child has opened the cache: the index exists
    # In flight on a tier at any moment, per thread: its temp file, or the victims it has taken
    # out of the index but not yet unlinked (demotion copies them first), which overshoot what it
    # needed by less than one entry: under 2 entries per writer thread.
    monitor = W.BudgetMonitor(dirs, {"ram": ram, "ssd": ssd}, allowance=procs * threads * 2 * 256 * KB)
    monitor.start()
    out = [results.get(timeout=100) for _ in ps]
    W.join_all(ps)
    monitor.stop.set()
    monitor.join()
    errors = [e for _, errs, _ in out for e in errs]
    assert not errors, "\n".join(errors[:3])
    assert all(p.exitcode == 0 for p in ps)
    assert monitor.samples > 0 and not monitor.violations, monitor.violations[:5]
    tiers = Counter()
    for _, _, t in out:
        tiers.update(t)
    assert sum(tiers.values()) == procs * threads * gets
    return keys, monitor, tiers


@pytest.mark.timeout(120)
def test_stress_budgets_bytes_and_no_deadlock(dirs):
    ram, ssd = 1 * MB, 2 * MB  # 40 keys of 64-256 KB: ~6.4 MB, far over both budgets
    keys, monitor, tiers = run_stress(dirs, ram, ssd)
    assert tiers["ssd"] > 0 and tiers["ram"] > 0
    fetched = fetch_counts(dirs)
    with open_cache(dirs, ram, ssd) as cache:  # alone now: reconciles, and must find nothing to fix
        assert cache.reconciled == {"partial": 0, "orphans": 0, "missing": 0}
        s = cache.stats()
        assert s["used_ram"] <= ram and s["used_ssd"] <= ssd
        assert s["fetches"] == s["misses"] == sum(fetched.values())
        assert s["evictions_ram"] > 0 and s["demotions"] > 0
        for tier, used in (("ram", s["used_ram"]), ("ssd", s["used_ssd"])):
            assert sum(W.data_files(os.path.join(dirs[tier], "data")).values()) == used
        for key, _ in cache.entries():  # whatever stayed is intact
            h = W.get_checked(cache, key, dirs["log"])
            h.release()
    assert not leftovers(ram_data(dirs), ssd_data(dirs))


@pytest.mark.timeout(120)
def test_stress_each_key_fetched_once_while_resident(dirs):
    ram = ssd = 12 * MB  # holds all 40 keys: nothing is ever evicted
    keys, monitor, tiers = run_stress(dirs, ram, ssd)
    fetched = fetch_counts(dirs)
    assert fetched and set(fetched) <= set(keys)
    assert all(n == 1 for n in fetched.values()), {k: n for k, n in fetched.items() if n != 1}
    assert tiers["pass"] == 0
    with open_cache(dirs, ram, ssd) as cache:
        s = cache.stats()
        assert s["misses"] == len(fetched) and s["evictions_ram"] == 0
        assert s["hits_ram"] == sum(tiers.values()) - len(fetched)


@pytest.mark.timeout(120)
def test_same_missing_key_from_8_processes_is_fetched_once(dirs):
    size = 2 * MB
    c = cfg(dirs, 16 * MB, 16 * MB)
    barrier, results = CTX.Barrier(8), CTX.Queue()
    ps = [CTX.Process(target=W.same_key_worker, args=(c, "hot", size, dirs["log"], barrier, results), daemon=True)
          for _ in range(8)]
    for p in ps:
        p.start()
    out = [results.get(timeout=100) for _ in ps]
    W.join_all(ps)
    assert [e for _, e, _ in out if e] == []
    assert [t for _, _, t in out] == ["ram"] * 8
    assert fetch_counts(dirs) == Counter({"hot": 1})
    with open_cache(dirs, 16 * MB, 16 * MB) as cache:
        s = cache.stats()
        assert (s["misses"], s["fetches"], s["hits_ram"]) == (1, 1, 7)


# --------------------------------------------------------------------------- 2. kill mid-write
BIG = 20 * MB


def _kill_fetcher_mid_write(dirs, c):
    mid = CTX.Event()
    p = CTX.Process(target=W.slow_fetcher, args=(c, "big", BIG, dirs["log"], mid), daemon=True)
    p.start()
    assert mid.wait(60), "the slow fetcher never got mid-way"
    return p


def _blocked_flock_waiters(path: str) -> int:
    ino = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return sum(1 for line in f if "->" in line and "FLOCK" in line and f":{ino} " in line)


@pytest.mark.timeout(120)
def test_fetcher_killed_mid_write_leaves_no_partial_entry(dirs):
    c = cfg(dirs, 64 * MB, 64 * MB)
    p = _kill_fetcher_mid_write(dirs, c)
    tmp = os.path.join(ram_data(dirs), f".tmp-{key_id('big')}")
    assert 0 < os.path.getsize(tmp) < BIG  # it really is mid-write
    p.kill()
    W.join_all([p])
    assert p.exitcode == -signal.SIGKILL
    with NodeCache(CacheConfig(**c)) as cache:  # alone: reconciles
        assert cache.reconciled["partial"] >= 1
        assert leftovers(ram_data(dirs), ssd_data(dirs)) == []
        assert cache.contains("big") is None
        with W.get_checked(cache, "big", dirs["log"], "refetch", size=BIG) as h:
            assert h.tier == "ram" and os.path.getsize(h.path) == BIG
        assert cache.contains("big") == "ram"
    assert fetch_counts(dirs) == Counter({"big": 2})
    assert fetch_counts(dirs, "refetch") == Counter({"big": 1})


@pytest.mark.timeout(120)
def test_waiter_takes_over_when_fetcher_is_killed(dirs):
    c = cfg(dirs, 64 * MB, 64 * MB)
    p = _kill_fetcher_mid_write(dirs, c)
    ready, results = CTX.Event(), CTX.Queue()
    w = CTX.Process(target=W.waiter, args=(c, "big", BIG, dirs["log"], ready, results), daemon=True)
    w.start()
    assert ready.wait(60)
    lock_file = os.path.join(dirs["ssd"], "control", "locks", f"{key_id('big')}.lock")
    deadline = time.monotonic() + 60
    while _blocked_flock_waiters(lock_file) == 0:  # the waiter is blocked in the kernel on the key lock
        assert time.monotonic() < deadline and w.is_alive(), "the waiter never blocked on the key lock"
        time.sleep(0.01)
    assert p.is_alive() and fetch_counts(dirs) == Counter({"big": 1})  # still the first fetch, mid-write
    p.kill()
    err, (tier, path), stats = results.get(timeout=100)
    W.join_all([p, w])
    assert err is None, err
    assert tier == "ram" and stats["fetches"] >= 1
    assert fetch_counts(dirs, "killed") == Counter({"big": 1})
    assert fetch_counts(dirs, "waiter") == Counter({"big": 1})  # the waiter fetched it itself
    assert leftovers(ram_data(dirs), ssd_data(dirs)) == []  # its temp was truncated and renamed
    with open_cache(dirs, 64 * MB, 64 * MB) as cache:
        with W.get_checked(cache, "big", dirs["log"], "again", size=BIG) as h:
            assert h.tier == "ram"
    assert fetch_counts(dirs, "again") == Counter()


# --------------------------------------------------------------------------- 3. crash reconciliation
SMALL, LARGE = 50 * KB, 500 * KB  # small keys fit the 400 KB RAM tier, large ones only the SSD


def _holder(c, log_dir, ready):
    cache = NodeCache(CacheConfig(**c))
    held = [W.get_checked(cache, f"s{i}", log_dir, size=SMALL) for i in range(4)]
    held += [W.get_checked(cache, f"b{i}", log_dir, size=LARGE) for i in range(2)]
    assert [h.tier for h in held] == ["ram"] * 4 + ["ssd"] * 2
    ready.set()
    time.sleep(600)  # SIGKILLed here, holding every entry


def _reopen_and_check(c, log_dir):
    cache = NodeCache(CacheConfig(**c))
    report = cache.reconciled
    contains = {k: cache.contains(k) for k in ("s0", "s1", "s2", "s3", "b0", "b1")}
    tiers = {}
    for key, size in (("b0", LARGE), ("b1", LARGE), ("s0", SMALL), ("s1", SMALL)):
        with W.get_checked(cache, key, log_dir, "reopen", size=size) as h:
            tiers[key] = h.tier
    stats = cache.stats()
    cache.close()
    return report, contains, tiers, stats


@pytest.mark.timeout(120)
def test_crash_reconciliation_and_ssd_reverification(dirs):
    c = cfg(dirs, 400 * KB, 4 * MB)
    ready = CTX.Event()
    p = CTX.Process(target=_holder, args=(c, dirs["log"], ready), daemon=True)
    p.start()
    assert ready.wait(60)
    p.kill()
    W.join_all([p])
    index = Index(os.path.join(dirs["ssd"], "control"))
    with index.read() as txn:
        files = {k: {t: r["file"] for t, r in e.tiers.items()} for k, e in txn.items()}
    index.close()
    assert set(files) == {"s0", "s1", "s2", "s3", "b0", "b1"}
    # the mess a crash (or a person) leaves behind
    for d in (ram_data(dirs), ssd_data(dirs)):
        for name in ("0123456789abcdef.feedface0000", f".tmp-{uuid.uuid4().hex}", f".pass-{uuid.uuid4().hex}"):
            Path(d, name).write_bytes(b"junk")
    os.unlink(os.path.join(ram_data(dirs), files["s1"]["ram"]))  # deleted by hand
    corrupt = os.path.join(ssd_data(dirs), files["b0"]["ssd"])
    with open(corrupt, "r+b") as f:  # flip one byte; the size stays right
        f.seek(LARGE // 2)
        b = f.read(1)
        f.seek(LARGE // 2)
        f.write(bytes([b[0] ^ 0xFF]))

    report, contains, tiers, stats = W.in_child(_reopen_and_check, c, dirs["log"])

    assert report == {"partial": 4, "orphans": 2, "missing": 1}
    assert contains == {"s0": "ram", "s1": None, "s2": "ram", "s3": "ram", "b0": "ssd", "b1": "ssd"}
    assert tiers == {"b0": "ssd", "b1": "ssd", "s0": "ram", "s1": "ram"}
    assert stats["corrupt"] == 1
    assert fetch_counts(dirs, "reopen") == Counter({"b0": 1, "s1": 1})  # only those two refetched
    assert leftovers(ram_data(dirs), ssd_data(dirs)) == []
    assert not os.path.exists(corrupt)
    for d in (ram_data(dirs), ssd_data(dirs)):
        assert "0123456789abcdef.feedface0000" not in W.data_files(d)


# --------------------------------------------------------------------------- 4. MIN is exact
def min_misses(seq, k):
    """Belady's MIN with bypass, independently: on a miss, insert if there is room, else replace
    the entry used furthest in the future only if the incoming one is used strictly sooner."""
    def nxt(x, t):
        return next((u for u in range(t + 1, len(seq)) if seq[u] == x), float("inf"))
    cached, misses = set(), 0
    for t, x in enumerate(seq):
        if x in cached:
            continue
        misses += 1
        if len(cached) < k:
            cached.add(x)
            continue
        victim = max(cached, key=lambda y: nxt(y, t))
        if nxt(x, t) < nxt(victim, t):
            cached.remove(victim)
            cached.add(x)
    return misses


def cache_misses(seq, k, policy, size=1000):
    with tempfile.TemporaryDirectory(dir=SHM) as d:
        c = CacheConfig(ram_bytes=k * size, ssd_bytes=0, ram_dir=f"{d}/ram", ssd_dir=f"{d}/ssd")
        with NodeCache(c, policy=policy) as cache:
            for x in seq:
                key = f"k{x}"
                with cache.get(key, lambda p, x=x: Path(p).write_bytes(bytes([x]) * size), size=size) as h:
                    assert h.read() == bytes([x]) * size
            s = cache.stats()
            assert s["used_ram"] <= k * size
            return s["misses"]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 4), seq=st.lists(st.integers(0, 6), min_size=1, max_size=40))
def test_clairvoyant_is_exactly_min_and_never_worse_than_lru(k, seq):
    keys = [f"k{x}" for x in seq]
    mn = cache_misses(seq, k, ClairvoyantPolicy(Schedule.from_sequence(keys), auto_advance=True))
    assert mn == min_misses(seq, k)
    assert mn <= cache_misses(seq, k, LRUPolicy())


# --------------------------------------------------------------------------- 5. pins
def _fill(cache, keys, log_dir, size):
    for k in keys:
        W.get_checked(cache, k, log_dir, size=size).release()


@pytest.mark.timeout(120)
def test_pinned_entry_is_never_evicted_even_by_another_process(dirs):
    size = 10 * KB
    cache = open_cache(dirs, 3 * size, 0, LRUPolicy())
    held = W.get_checked(cache, "a", dirs["log"], size=size)
    # another process (forked: it uses the inherited cache) churns through the tier
    W.in_child(_fill, cache, [f"x{i}" for i in range(8)], dirs["log"], size)
    s = cache.stats()
    assert s["evictions_ram"] >= 6 and s["used_ram"] <= 3 * size
    assert cache.contains("a") == "ram"
    assert os.path.exists(held.path) and held.read() == W.key_bytes("a", size)
    held.release()
    _fill(cache, ["y0", "y1", "y2"], dirs["log"], size)
    assert cache.contains("a") is None and not os.path.exists(held.path)  # evictable once released
    cache.close()


def test_everything_pinned_serves_pass_through_within_budget(dirs):
    size = 10 * KB
    with open_cache(dirs, 3 * size, 0, LRUPolicy()) as cache:
        held = [W.get_checked(cache, k, dirs["log"], size=size) for k in ("a", "b", "c")]
        extra = W.get_checked(cache, "d", dirs["log"], size=size)  # bytes checked inside
        assert extra.tier == "pass" and os.path.exists(extra.path)
        s = cache.stats()
        assert s["used_ram"] == 3 * size and s["bypassed"] == 1
        assert sum(W.data_files(ram_data(dirs)).values()) == 4 * size  # budget + the one pass file
        extra.release()
        assert not os.path.exists(extra.path) and cache.contains("d") is None
        assert [h.tier for h in held] == ["ram"] * 3
        for h in held:
            h.release()
        assert leftovers(ram_data(dirs)) == []


# --------------------------------------------------------------------------- 6. demotion / promotion
def test_lru_demotes_ram_victims_and_promotes_ssd_hits(dirs):
    size = 10 * KB
    with open_cache(dirs, 2 * size, 10 * size, LRUPolicy()) as cache:
        _fill(cache, [f"k{i}" for i in range(5)], dirs["log"], size)
        s = cache.stats()
        assert (s["evictions_ram"], s["demotions"], s["entries_ram"], s["entries_ssd"]) == (3, 3, 2, 3)
        assert [cache.contains(f"k{i}") for i in range(5)] == ["ssd"] * 3 + ["ram"] * 2
        with W.get_checked(cache, "k0", dirs["log"], size=size) as h:
            assert h.tier == "ram"  # an SSD hit, promoted
        s = cache.stats()
        assert (s["hits_ssd"], s["promotions"], s["misses"]) == (1, 1, 5)
        assert cache.contains("k0") == "ram"
    assert fetch_counts(dirs) == Counter({f"k{i}": 1 for i in range(5)})


def test_contains_all_and_index_reads_hand_out_entries_of_their_own(dirs):
    """``contains_all`` answers for a set of keys in one read; the index's decoded entries (kept by
    their bytes) are each caller's own: a change to one is neither in the index nor in the next read."""
    size = 4 * KB
    with open_cache(dirs, 3 * size, 0, LRUPolicy()) as cache:
        _fill(cache, ["a", "b"], dirs["log"], size)
        assert cache.contains_all(["a", "b"]) and cache.contains_all([])
        assert not cache.contains_all(["a", "nope"])
        first = cache.index.get("a")
        assert first is not None and "ram" in first.tiers
        first.tiers.clear()
        first.tiers["ssd"] = {"file": "x"}
        again, other = cache.index.get_many(["a", "b"])
        assert again is not None and other is not None and "ram" in again.tiers and "ssd" not in again.tiers
        assert again.tiers["ram"] is not cache.index.get("a").tiers["ram"]
        assert cache.contains("a") == "ram" and cache.index.get("nope") is None


class _NoPromotion(LRUPolicy):
    def should_promote(self, key):
        return False


def test_promotion_after_a_stale_lookup_leaves_a_pinned_ram_copy_alone(dirs):
    size = 10 * KB
    with open_cache(dirs, 2 * size, 10 * size, _NoPromotion()) as cache:
        _fill(cache, ["k0", "k1", "k2"], dirs["log"], size)  # k0 demoted to SSD
        stale = dict(cache.entries())["k0"]  # what a lookup read just before someone promoted k0
        on_ssd = W.get_checked(cache, "k0", dirs["log"], size=size)
        assert on_ssd.tier == "ssd"
        cache.set_policy(LRUPolicy())
        in_ram = W.get_checked(cache, "k0", dirs["log"], size=size)  # the other promotion, pinned
        assert in_ram.tier == "ram"
        assert cache._promote("k0", stale, on_ssd, locked=False) is None  # our late attempt backs off
        assert os.path.exists(in_ram.path) and in_ram.read() == W.key_bytes("k0", size)
        assert dict(cache.entries())["k0"].tiers["ram"]["file"] == os.path.basename(in_ram.path)
        for h in (on_ssd, in_ram):
            h.release()


@pytest.mark.parametrize("seq, demoted, gone", [
    ("a b c b c", [], ["a"]),  # a is never used again: evicted, not demoted
    ("a b c c a b", ["b"], []),  # b is used again: demoted, then served from SSD (not promoted: last use)
])
def test_clairvoyant_demotes_only_what_is_used_again(dirs, seq, demoted, gone):
    size = 10 * KB
    keys = seq.split()
    policy = ClairvoyantPolicy(Schedule.from_sequence(keys), auto_advance=True)
    with open_cache(dirs, 2 * size, 10 * size, policy) as cache:
        served = []
        for k in keys:
            with W.get_checked(cache, k, dirs["log"], size=size) as h:
                served.append(h.tier)
        s = cache.stats()
        assert s["demotions"] == len(demoted) and s["evictions_ram"] == 1
        if demoted:
            assert "ssd" in served and s["hits_ssd"] == 1 and s["promotions"] == 0
        for k in gone:
            assert cache.contains(k) is None and s["entries_ssd"] == 0
        assert s["misses"] == 3


# --------------------------------------------------------------------------- 7. degrade


def test_budget_shrinks_to_a_small_filesystem_with_one_warning(small_tmpfs, dirs, caplog):
    caplog.set_level(logging.WARNING, logger="datacache.cache.node")
    c = CacheConfig(ram_bytes=100 * MB, ssd_bytes=0, ram_dir=str(small_tmpfs / "ram"), ssd_dir=dirs["ssd"])
    with NodeCache(c, policy=LRUPolicy()) as cache:
        assert 16 * MB <= cache.ram.budget <= 32 * MB and cache.ram.enabled
        for i in range(40):  # 40 MB through a ~30 MB tier
            with W.get_checked(cache, f"m{i}", dirs["log"], size=1 * MB) as h:
                assert h.tier == "ram"
        s = cache.stats()
        assert s["used_ram"] <= cache.ram.budget and s["evictions_ram"] > 0 and s["budget_ram"] == cache.ram.budget
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "shrunk" in warnings[0], warnings


def test_unwritable_ssd_dir_disables_the_tier_and_ram_keeps_serving(tmp_path, dirs, caplog):
    caplog.set_level(logging.WARNING, logger="datacache.cache.node")
    (tmp_path / "file").write_bytes(b"not a directory")
    c = CacheConfig(ram_bytes=1 * MB, ssd_bytes=1 * MB, ram_dir=dirs["ram"], ssd_dir=str(tmp_path / "file" / "x"))
    with NodeCache(c) as cache:
        assert not cache.ssd.enabled and cache.ram.enabled
        assert any("ssd tier disabled" in r.getMessage() for r in caplog.records)
        for _ in range(2):
            with W.get_checked(cache, "k", dirs["log"], size=100 * KB) as h:
                assert h.tier == "ram"
        assert cache.stats()["hits_ram"] == 1


@pytest.mark.parametrize("which", ["ram", "ssd"])
def test_cache_dir_owned_by_another_user_is_refused(dirs, which):
    os.makedirs(dirs[which], mode=0o700)
    owner = give_away(dirs[which])  # root: chown; a normal user: tests/test_as_user.py
    with pytest.raises(CacheError) as ei:
        open_cache(dirs, 1 * MB, 1 * MB)
    assert dirs[which] in str(ei.value) and f"uid {owner}," in str(ei.value)


def test_pass_through_fallback_owned_by_another_user_is_skipped(tmp_path, monkeypatch):
    """After ENOSPC, a fallback pass directory that another user made first (``/dev/shm`` is
    world-writable) is skipped for the next file system, not raised."""
    import errno

    from datacache.cache import handles as _handle

    taken, free = tmp_path / "shm", tmp_path / "tmp"
    (taken / f"datacache-pass-{os.getuid()}").mkdir(parents=True)
    free.mkdir()
    give_away(taken / f"datacache-pass-{os.getuid()}")
    monkeypatch.setattr(_handle, "fallback_bases", lambda: (str(taken), str(free)))
    pd = _handle.PassDir([], str(tmp_path / "control"))
    pd.path = str(tmp_path / "gone")  # the full file system (not there any more: no st_dev check)
    assert pd.move_after(pd.path, OSError(errno.ENOSPC, "No space left on device"))
    assert pd.path == str(free / f"datacache-pass-{os.getuid()}")


def test_cache_dirs_are_private(dirs):
    os.makedirs(dirs["ssd"], mode=0o755)
    os.chmod(dirs["ssd"], 0o755)  # an existing, too open directory is tightened
    old = os.umask(0)
    try:
        with open_cache(dirs, 1 * MB, 1 * MB) as cache:
            paths = [dirs["ram"], ram_data(dirs), dirs["ssd"], ssd_data(dirs), cache.control_dir, cache.lock_dir]
            assert {p: stat.S_IMODE(os.stat(p).st_mode) for p in paths} == {p: 0o700 for p in paths}
    finally:
        os.umask(old)


# --------------------------------------------------------------------------- 8. stats
def _stats_worker(c, prefix, log_dir):
    with NodeCache(CacheConfig(**c)) as cache:
        _fill(cache, [f"{prefix}{i}" for i in range(3)] * 2, log_dir, 10 * KB)  # 3 misses, 3 hits
        W.get_checked(cache, f"{prefix}-huge", log_dir, size=2 * MB).release()  # larger than both tiers
    return True


def _stats_of(c):
    with NodeCache(CacheConfig(**c)) as cache:
        return cache.stats()


@pytest.mark.timeout(120)
def test_stats_are_summed_across_processes(dirs):
    c = cfg(dirs, 1 * MB, 1 * MB)
    ps = [CTX.Process(target=_stats_worker, args=(c, p, dirs["log"])) for p in ("p", "q")]
    for p in ps:
        p.start()
    W.join_all(ps)
    assert [p.exitcode for p in ps] == [0, 0]
    s = W.in_child(_stats_of, c)
    assert (s["misses"], s["fetches"], s["hits_ram"], s["bypassed"]) == (8, 8, 6, 2)
    assert s["bytes_ram"] == 6 * 10 * KB and s["remote_bytes"] == 2 * (3 * 10 * KB + 2 * MB)


# --------------------------------------------------------------------------- 9. fork
def _forked_use(cache, held, log_dir):
    with W.get_checked(cache, "b", log_dir, size=10 * KB) as h:
        tier = h.tier
    held.release()  # as if a copy of the parent's handle were garbage collected in the child
    s = cache.stats()
    cache.close()
    return tier, s["misses"]


@pytest.mark.timeout(120)
def test_cache_is_usable_in_a_forked_child_and_in_the_parent_after(dirs):
    cache = open_cache(dirs, 1 * MB, 1 * MB)
    held = W.get_checked(cache, "a", dirs["log"], size=10 * KB)
    assert W.in_child(_forked_use, cache, held, dirs["log"]) == ("ram", 2)
    # the child's release and close touched only its own locks: the parent's pin and node lock hold
    for path in (held.path, os.path.join(cache.control_dir, "node.lock")):
        fd = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert held.read() == W.key_bytes("a", 10 * KB)
    with W.get_checked(cache, "b", dirs["log"], size=10 * KB) as h:  # the child's entry
        assert h.tier == "ram"
    W.get_checked(cache, "c", dirs["log"], size=10 * KB).release()
    held.release()
    s = cache.stats()
    assert (s["misses"], s["hits_ram"]) == (3, 1)
    assert fetch_counts(dirs) == Counter({"a": 1, "b": 1, "c": 1})
    cache.close()



@pytest.mark.timeout(120)
def test_fork_spares_lmdb_transactions_in_flight_in_other_threads(dirs):
    cache = open_cache(dirs, 1 * MB, 1 * MB)
    _fill(cache, ["a"], dirs["log"], 10 * KB)
    from datacache.cache import index as index_module

    in_txn, seen = threading.Event(), []

    def reader():
        with cache.index.read() as txn:
            in_txn.set()
            # the fork in the main thread waits for this transaction (was: a 0.5 s sleep, which a
            # slow fork could outlast); it must neither break this snapshot nor its reader slot
            wait_for(lambda: index_module._gate._waiters, 60, "the fork to wait for the transaction")
            assert txn.get("a") is not None
            readers = [line.split() for line in cache.index.env.readers().splitlines()[1:]]
            seen.append(any(r[0] == str(os.getpid()) and r[-1] != "-" for r in readers))

    t = threading.Thread(target=reader)
    t.start()
    assert in_txn.wait(60)
    W.in_child(_fill, cache, ["b"], dirs["log"], 10 * KB)  # the child re-opens and uses the index
    t.join()
    assert seen == [True]
    with W.get_checked(cache, "b", dirs["log"], size=10 * KB) as h:
        assert h.tier == "ram"
    cache.close()


def _open_at_once(c, barrier, results):
    try:
        barrier.wait()
        with NodeCache(CacheConfig(**c)) as cache:
            results.put((cache.ram.enabled, cache.ssd.enabled, cache.reconciled))
    except BaseException as exc:
        results.put((repr(exc), None, None))


@pytest.mark.timeout(120)
def test_processes_joining_while_the_first_reconciles_keep_their_tiers(dirs):
    # junk for the first opener to clean up, so the others create their tier probes meanwhile
    for tier in ("ram", "ssd"):
        os.makedirs(os.path.join(dirs[tier], "data"), mode=0o700)
        for i in range(1000):
            Path(dirs[tier], "data", f".tmp-junk{i}").write_bytes(b"")
    c = cfg(dirs, 1 * MB, 1 * MB)
    barrier, results = CTX.Barrier(8), CTX.Queue()
    ps = [CTX.Process(target=_open_at_once, args=(c, barrier, results), daemon=True) for _ in range(8)]
    for p in ps:
        p.start()
    out = [results.get(timeout=100) for _ in ps]
    W.join_all(ps)
    assert [(r, s) for r, s, _ in out] == [(True, True)] * 8
    assert sum(rep is not None for _, _, rep in out) >= 1  # somebody reconciled
    assert leftovers(ram_data(dirs), ssd_data(dirs)) == []
