"""Eviction policies: the Schedule clock, LRU and clairvoyant scores, and MIN's bound on epochs."""
from __future__ import annotations

import math
import os
import random
import tempfile
import time
from pathlib import Path

import pytest

from datacache.cache.eviction import ClairvoyantPolicy, LRUPolicy, Schedule
from datacache.cache.node import NodeCache
from datacache.config import CacheConfig

INF = math.inf
SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def test_schedule_from_sequence_next_use_and_advance():
    s = Schedule.from_sequence(["a", "b", "a", "c"])
    assert s.now == -INF
    assert (s.next_use("a"), s.next_use("b"), s.next_use("c"), s.next_use("zzz")) == (0, 1, 3, INF)
    s.advance(0)  # next_use is strictly after now
    assert (s.next_use("a"), s.next_use("b")) == (2, 1)
    s.advance(1.5)
    assert (s.next_use("a"), s.next_use("b"), s.next_use("c")) == (2, INF, 3)
    s.advance(0.5)  # never backwards
    assert s.now == 1.5 and s.next_use("b") == INF
    s.advance(3)
    assert all(s.next_use(k) == INF for k in "abc")
    assert s.knows("a") and not s.knows("zzz")


def test_schedule_from_plans_interleaves_consumers_on_one_clock():
    s = Schedule.from_plans({0: [["a", "b"], ["c", "d", "e", "f"]], 1: [["b", "a"]]})
    # consumer i of n reads its j-th key at epoch + j / n
    assert [s.next_use(k) for k in "abcdef"] == [0, 0.5, 0, 0.25, 0.5, 0.75]
    s.advance(0.5)
    assert [s.next_use(k) for k in "abcdef"] == [1.5, 1, INF, INF, INF, 0.75]
    s.advance(1)
    assert (s.next_use("a"), s.next_use("b")) == (1.5, INF)


def test_advance_to_next_follows_one_consumer_including_repeated_reads():
    s = Schedule.from_sequence(["a", "a", "b", "a", "b"])
    steps = []
    for key in ["a", "a", "b", "a", "b"]:
        s.advance_to_next(key)
        steps.append((s.now, s.next_use(key)))
    # after each read, the clock is at that read and the key's next use is its following read
    assert steps == [(0, 1), (1, 3), (2, 4), (3, INF), (4, INF)]
    s.advance_to_next("zzz")  # an unknown key does not move the clock
    assert s.now == 4


def test_advance_to_next_takes_a_read_at_the_current_time_once():
    s = Schedule({"a": [0.0, 1.0], "b": [0.5]}, now=0.0)
    s.advance_to_next("a")  # the read at now=0 is a's first
    assert s.now == 0.0 and s.next_use("a") == 1.0
    s.advance_to_next("a")
    assert s.now == 1.0
    s.advance(2.0)
    s.advance_to_next("a")
    assert s.now == 2.0  # nothing left to read


def test_lru_scores_evict_the_least_recently_used_first():
    lru = LRUPolicy()
    now = time.time()
    atimes = {"old": now - 30, "mid": now - 10, "new": now}
    ranked = sorted(atimes, key=lambda k: lru.score(k, atimes[k]), reverse=True)
    assert ranked == ["old", "mid", "new"]
    assert lru.incoming_score("x") <= lru.score("new", atimes["new"])  # an insert is the most recent
    assert not lru.bypass and lru.worth_keeping("old") and lru.should_promote("old")


def test_clairvoyant_scores_follow_the_schedule():
    s = Schedule.from_sequence(["a", "b", "c", "b"])
    p = ClairvoyantPolicy(s)
    s.advance(0)
    # score ignores atime: furthest next use first, never-again (inf) before all
    ranked = sorted("abc", key=lambda k: p.score(k, atime=time.time()), reverse=True)
    assert ranked == ["a", "c", "b"] and p.score("a", 0) == INF
    assert p.incoming_score("c") == 2 and p.bypass
    assert not p.worth_keeping("a") and p.worth_keeping("b")
    assert not p.should_promote("a") and p.should_promote("c")
    p.on_access("b")  # auto_advance off: the clock is the consumer's business
    assert s.now == 0
    q = ClairvoyantPolicy(Schedule.from_sequence(["a", "b", "a"]), auto_advance=True)
    q.on_access("a")
    q.on_access("b")
    assert q.schedule.now == 1 and q.score("a", 0) == 2


def _epoch_misses(policy_for, d=20, c=10, epochs=(1, 2, 3), size=1000, seed=7):
    """Read ``d`` equal shards once per epoch in a fresh order through a RAM cache of ``c``."""
    rng = random.Random(seed)
    perms = {e: rng.sample([f"s{i:02d}" for i in range(d)], d) for e in epochs}
    policy, schedule = policy_for(perms)
    out = []
    with tempfile.TemporaryDirectory(dir=SHM) as tmp:
        cfg = CacheConfig(ram_bytes=c * size, ssd_bytes=0, ram_dir=f"{tmp}/ram", ssd_dir=f"{tmp}/ssd")
        with NodeCache(cfg, policy=policy) as cache:
            for e in epochs:
                before = cache.stats()["misses"]
                for i, key in enumerate(perms[e]):
                    if schedule is not None:
                        schedule.advance(e + i / d)
                    data = key.encode() * (size // len(key))
                    with cache.get(key, lambda p, data=data: Path(p).write_bytes(data), size=len(data)) as h:
                        assert h.read() == data
                s = cache.stats()
                assert s["used_ram"] <= c * size
                out.append(s["misses"] - before)
    return out


def _clairvoyant(perms):
    schedule = Schedule.from_plans({e: [perm] for e, perm in perms.items()})
    return ClairvoyantPolicy(schedule), schedule


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_min_reaches_the_bound_on_reshuffled_epochs(seed):
    d, c = 20, 10
    mn = _epoch_misses(_clairvoyant, d, c, seed=seed)
    assert mn == [d, d - c, d - c]  # cold, then exactly D - C per epoch: every cached shard is a hit
    lru = _epoch_misses(lambda perms: (LRUPolicy(), None), d, c, seed=seed)
    assert lru[0] == d and all(m >= d - c for m in lru[1:])  # no policy beats D - C
    assert sum(lru) >= sum(mn)


def test_ram_bypass_falls_through_to_ssd(tmp_path):
    """Clairvoyant: what RAM turns down (used later than all it holds) goes to SSD if SSD wants it,
    so a two-tier cache behaves like one MIN cache of RAM + SSD entries."""
    from datacache import CacheConfig, ClairvoyantPolicy, NodeCache, Schedule
    from datacache.hashing import hash_bytes

    size = 1000
    seq = [f"k{i}" for i in range(6)] * 2
    cfg = CacheConfig(ram_bytes=2 * size, ssd_bytes=4 * size, ram_dir=str(tmp_path / "ram"),
                      ssd_dir=str(tmp_path / "ssd"))
    data = {k: k.encode() * (size // len(k)) for k in set(seq)}
    data = {k: v.ljust(size, b"-") for k, v in data.items()}
    with NodeCache(cfg, policy=ClairvoyantPolicy(Schedule.from_sequence(seq), auto_advance=True)) as cache:
        tiers = []
        for k in seq:
            with cache.get(k, lambda p, k=k: open(p, "wb").write(data[k]), size=size, hash=hash_bytes(data[k])) as h:
                assert h.read() == data[k]
                tiers.append(h.tier)
        st = cache.stats()
    # first pass: 6 misses, all cached (2 in RAM, 4 on SSD); second pass: 6 hits, no fetch
    assert st["misses"] == 6 and st["hits_ram"] + st["hits_ssd"] == 6, st
    assert "pass" not in tiers


def test_ssd_drops_its_copy_of_a_ram_entry_first(tmp_path):
    """An SSD hit promoted to RAM leaves a copy on SSD; when SSD needs room that copy goes before any
    entry held only on SSD, so RAM + SSD hold RAM + SSD distinct entries: three keys through one RAM
    and two SSD slots are each fetched once (with the copy kept, b's SSD copy was evicted and
    fetched again)."""
    from datacache import CacheConfig, ClairvoyantPolicy, NodeCache, Schedule
    from datacache.hashing import hash_bytes

    size, seq = 1000, list("ababcbac")
    data = {k: (k * size).encode() for k in set(seq)}
    cfg = CacheConfig(ram_bytes=size, ssd_bytes=2 * size, ram_dir=str(tmp_path / "ram"), ssd_dir=str(tmp_path / "ssd"))
    with NodeCache(cfg, policy=ClairvoyantPolicy(Schedule.from_sequence(seq), auto_advance=True)) as cache:
        for k in seq:
            with cache.get(k, lambda p, k=k: open(p, "wb").write(data[k]), size=size, hash=hash_bytes(data[k])) as h:
                assert h.read() == data[k]
        st = cache.stats()
    assert st["misses"] == 3 and st["promotions"] > 0, st
