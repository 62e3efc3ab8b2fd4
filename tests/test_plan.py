"""Property tests of the pure epoch plan (datacache.plan.epoch): exactly once, equal ranks, purity, the sliding window,
remainders. Replication is tested at the dataset level (tests/test_dataset.py)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from datacache.plan.epoch import (
    PlanSpec,
    build_plan,
    first_shards,
    global_order,
    mixed_share,
    remainder_order,
    split_even,
)
from tests.helpers.plans import all_plans, check_exactly_once_and_equal_ranks

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

counts_st = st.lists(st.integers(0, 50), min_size=1, max_size=20).filter(lambda c: sum(c) >= 1)


@st.composite
def specs(draw: st.DrawFn) -> PlanSpec:
    return PlanSpec(seed=draw(st.integers(0, 2**31 - 1)), epoch=draw(st.integers(0, 1000)),
                    shuffle=draw(st.booleans()), window=draw(st.integers(1, 5)), drop_last=draw(st.booleans()),
                    dp_size=draw(st.integers(1, 5)), num_workers=draw(st.integers(1, 4)),
                    mix_bytes=draw(st.sampled_from([0, 0, 1 << 40])), chunk_bytes=draw(st.integers(1, 60)),
                    in_turns=draw(st.integers(0, 1)))


def shard_of(counts: list[int], ids: np.ndarray) -> np.ndarray:
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return np.searchsorted(offsets, ids, side="right") - 1


@SETTINGS
@given(counts_st, specs())
def test_exactly_once_and_equal_ranks(counts: list[int], spec: PlanSpec) -> None:
    check_exactly_once_and_equal_ranks(counts, spec)


@SETTINGS
@given(counts_st, specs())
def test_plan_is_pure(counts: list[int], spec: PlanSpec) -> None:
    a, b = all_plans(counts, spec), all_plans(list(counts), replace(spec))
    for k in a:
        assert np.array_equal(a[k].samples, b[k].samples)
        assert a[k].runs == b[k].runs and np.array_equal(a[k].steps, b[k].steps) and a[k].padded == b[k].padded
        shards_only = build_plan(np.array(counts), replace(spec, dp_rank=k[0], worker_id=k[1]), shards_only=True)
        assert shards_only.samples is None and shards_only.runs == a[k].runs
        assert (shards_only.rows is None) == (a[k].rows is None)
        assert len(shards_only) == len(a[k])


@SETTINGS
@given(st.lists(st.integers(0, 50), min_size=1, max_size=20).filter(lambda c: sum(c) >= 20),
       st.integers(0, 2**31 - 1), st.integers(0, 1000), st.integers(1, 5))
def test_epochs_and_seeds_reshuffle(counts: list[int], seed: int, epoch: int, window: int) -> None:
    spec = PlanSpec(seed=seed, epoch=epoch, window=window)
    base = build_plan(np.array(counts), spec).samples
    assert sorted(base.tolist()) == list(range(sum(counts)))
    assert not np.array_equal(base, build_plan(np.array(counts), replace(spec, epoch=epoch + 1)).samples)
    assert not np.array_equal(base, build_plan(np.array(counts), replace(spec, seed=seed + 1)).samples)


@SETTINGS
@given(counts_st, specs())
def test_no_shuffle_keeps_global_order(counts: list[int], spec: PlanSpec) -> None:
    spec = replace(spec, shuffle=False, in_turns=0)
    plans = all_plans(counts, spec)
    got = np.concatenate([plans[r, w].samples for r in range(spec.dp_size) for w in range(spec.num_workers)])
    pieces, padded = split_even(np.arange(sum(counts)), spec.dp_size, spec.drop_last)
    assert np.array_equal(got, np.concatenate(pieces))
    assert padded == plans[0, 0].padded


@SETTINGS
@given(counts_st, specs(), st.integers(1, 7))
def test_batches_dealt_in_turn_come_in_the_global_order(counts: list[int], spec: PlanSpec, batch_size: int) -> None:
    """``in_turns`` (an unshuffled dataset's plan, issue 37 point 6): each rank's batches taken
    from its workers in turn, as torch's DataLoader takes them, are the rank's part of the global
    order; every worker but the one with the rank's last batch holds whole batches."""
    spec = replace(spec, shuffle=False, in_turns=1, batch_size=batch_size)
    plans = all_plans(counts, spec)
    pieces, _ = split_even(np.arange(sum(counts)), spec.dp_size, spec.drop_last, unit=batch_size)
    for r in range(spec.dp_size):
        batches = [np.array_split(plans[r, w].samples, range(batch_size, len(plans[r, w]), batch_size))
                   for w in range(spec.num_workers)]
        taken = [b[k] for k in range(max(map(len, batches))) for b in batches if k < len(b) and len(b[k])]
        got = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
        assert np.array_equal(got, pieces[r])
        assert sum(len(b[-1]) < batch_size for b in batches if b and len(b[-1])) <= 1


@SETTINGS
@given(counts_st, specs())
def test_sliding_window_pipeline(counts: list[int], spec: PlanSpec) -> None:
    """Step i reads only runs i-window+1 .. i, so a consumer holds at most `window` runs open, and
    each run reads only its own shard's local range."""
    for plan in all_plans(counts, spec).values():
        w = plan.window
        mixed = plan.rows is not None  # a node mix's (datacache.plan.node_shuffle): a run stays open for its chunk
        assert w == (spec.window if spec.shuffle else 1) or mixed
        assert plan.steps[0] == 0 and plan.steps[-1] == len(plan)
        assert np.all(np.diff(plan.steps) >= 0)
        for i in range(len(plan.steps) - 1):
            runs = plan.run_of[plan.steps[i]:plan.steps[i + 1]]
            assert np.all((runs <= i) & (runs > i - w)), "a step reads a run that is not open"
        sh = shard_of(counts, plan.samples)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        for r, (shard, lo, hi) in enumerate(plan.runs):
            mine = plan.run_of == r
            assert np.all(sh[mine] == shard)
            local = plan.samples[mine] - offsets[shard]
            assert local.min() >= lo and local.max() < hi
        assert plan.shard_sequence == [r[0] for r in plan.runs]
        times = plan.shard_times(3)
        assert [s for s, _ in times] == plan.shard_sequence
        assert all(3 <= t < 4 for _, t in times)
        assert [t for _, t in times] == sorted(t for _, t in times)


@st.composite
def consumed_for(draw: st.DrawFn, counts: list[int], spec: PlanSpec) -> list[int]:
    lengths = [len(build_plan(np.array(counts), replace(spec, worker_id=w), shards_only=True))
               for w in range(spec.num_workers)]
    return [draw(st.integers(0, n)) for n in lengths]


def unread(counts: list[int], spec: PlanSpec, consumed: list[int], order=None) -> tuple[set[int], set[int]]:
    """(every real sample of the plans, samples read) given per-worker consumed counts."""
    plans = all_plans(counts, spec, order=order)
    every = set(np.concatenate([p.samples for p in plans.values()]).tolist())
    read = set()
    for (_, w), p in plans.items():
        read |= set(p.samples[:consumed[w]].tolist())
    return every, read


@SETTINGS
@given(st.data(), counts_st, specs())
def test_remainder_is_every_unread_sample_once(data: st.DataObject, counts: list[int], spec: PlanSpec) -> None:
    consumed = data.draw(consumed_for(counts, spec))
    rest = remainder_order(np.array(counts), spec, consumed)
    every, read = unread(counts, spec, consumed)
    assert len(set(rest.tolist())) == len(rest), "remainder repeats a sample"
    assert set(rest.tolist()) == every - read
    if not spec.drop_last:
        assert every == set(range(sum(counts)))


@SETTINGS
@given(st.data(), counts_st, specs(), st.integers(1, 5), st.integers(1, 4))
def test_remainder_of_a_remainder(data: st.DataObject, counts: list[int], spec: PlanSpec, dp2: int, nw2: int) -> None:
    """Elastic twice: world A reads some, world B resumes from A's remainder and reads some, world C
    resumes; C's remainder must be exactly what neither A nor B read."""
    spec = replace(spec, drop_last=False)
    c = np.array(counts)
    consumed_a = data.draw(consumed_for(counts, spec))
    order_b = remainder_order(c, spec, consumed_a)
    _, read_a = unread(counts, spec, consumed_a)
    spec_b = replace(spec, dp_size=dp2, num_workers=nw2)
    assume(len(order_b) > 0)
    lengths = [len(build_plan(c, replace(spec_b, worker_id=w), order=order_b))
               for w in range(nw2)]
    consumed_b = [data.draw(st.integers(0, n)) for n in lengths]
    _, read_b = unread(counts, spec_b, consumed_b, order=order_b)
    order_c = remainder_order(c, spec_b, consumed_b, order=order_b)
    assert len(set(order_c.tolist())) == len(order_c)
    assert set(order_c.tolist()) == set(range(sum(counts))) - read_a - read_b


def test_split_even_small_cases() -> None:
    pieces, padded = split_even(np.arange(5), 3, drop_last=False)
    assert [p.tolist() for p in pieces] == [[0, 1], [2, 3], [4, 0]] and padded == 1
    pieces, padded = split_even(np.arange(5), 3, drop_last=True)
    assert [p.tolist() for p in pieces] == [[0], [1], [2]] and padded == 0
    pieces, padded = split_even(np.arange(1), 4, drop_last=False)
    assert [p.tolist() for p in pieces] == [[0]] * 4 and padded == 3
    assert [len(p) for p in split_even(np.zeros(0, dtype=np.int64), 2, False)[0]] == [0, 0]


def test_global_order_is_shard_contiguous() -> None:
    counts = np.array([3, 0, 2, 4])
    order = global_order(counts, PlanSpec(seed=7, epoch=2))
    assert sorted(order.tolist()) == list(range(9))
    runs = [int(s) for s in shard_of(counts.tolist(), order)]
    assert [s for i, s in enumerate(runs) if i == 0 or runs[i - 1] != s] == sorted(set(runs), key=runs.index)


@pytest.mark.parametrize("bad", [dict(dp_rank=2, dp_size=2), dict(worker_id=3, num_workers=3), dict(window=0)])
def test_spec_validation(bad: dict) -> None:
    with pytest.raises(ValueError):
        PlanSpec(**bad)


@pytest.mark.parametrize("num_workers,batch_size,num_nodes", [(1, 1, 1), (2, 32, 1), (3, 1, 1), (8, 4, 1), (4, 8, 2)])
def test_first_shards_are_each_workers_first_run(num_workers: int, batch_size: int, num_nodes: int) -> None:
    """``first_shards`` (the workers' lead at an epoch's start) is what each worker's own plan
    reads first; a worker with nothing to read has None; a node-mixed epoch has none at all."""
    counts = np.array([244] * 31 + [64])
    for rank in range(4):
        spec = PlanSpec(seed=3, epoch=1, num_workers=num_workers, batch_size=batch_size, dp_size=4, dp_rank=rank,
                        num_nodes=num_nodes)
        firsts = first_shards(counts, spec)
        plans = [build_plan(counts, replace(spec, worker_id=w)) for w in range(num_workers)]
        assert firsts == [p.runs[0][0] if p.runs else None for p in plans]
    tiny = PlanSpec(num_workers=8, dp_size=1, dp_rank=0)
    assert first_shards(np.array([3]), tiny).count(None) == 5  # 3 samples, 8 workers
    mixed = PlanSpec(epoch=1, num_workers=2, dp_size=1, dp_rank=0, mix_bytes=10**9, mix_from=0,
                     shard_bytes=counts * 1000)
    assert mixed_share(counts, mixed) is not None and first_shards(counts, mixed) == []


@SETTINGS
@given(st.lists(st.integers(1, 60), min_size=2, max_size=30), st.integers(1, 3), st.integers(1, 6), st.integers(0, 99))
def test_a_workers_last_run_is_the_largest_of_its_last_window(counts: list[int], workers: int, window: int,
                                                               seed: int) -> None:
    """Shuffled, no run among a worker's last ``window`` (its first excepted) is larger than its
    last one: a small last run would leave the steps of the run before it to the epoch's end too.
    Unshuffled plans keep their order."""
    c = np.array(counts)
    for w in range(workers):
        spec = PlanSpec(seed=seed, num_workers=workers, worker_id=w, window=window, dp_size=1, dp_rank=0)
        runs = build_plan(c, spec).runs
        sizes = [hi - lo for _, lo, hi in runs]
        if len(runs) > 2:
            assert sizes[-1] == max(sizes[max(1, len(runs) - window):]), sizes
        plain = build_plan(c, replace(spec, shuffle=False)).runs
        assert [r[0] for r in plain] == sorted(r[0] for r in plain)
