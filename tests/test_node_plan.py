"""Property tests of the node-sticky epoch plan (datacache.plan.epoch with ``num_nodes > 1``,
datacache.plan.node_assign): exactly once and equal ranks as before, each node reading the same shards
every epoch (reshuffled within its share), a balanced assignment that barely moves when the node
count changes, elastic remainders across node counts, and one node unchanged."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from datacache.plan.epoch import PlanSpec, build_plan, piece_runs, remainder_order, split_even
from datacache.plan.node_assign import assign_nodes
from tests.helpers.plans import SETTINGS, all_plans, check_exactly_once_and_equal_ranks, counts_st, node_specs


def node_reads(counts: list[int], spec: PlanSpec) -> dict[int, Counter]:
    """{node: Counter of shards (runs) its consumers read}."""
    out: dict[int, Counter] = {}
    for (r, _), p in all_plans(counts, spec).items():
        out.setdefault(replace(spec, dp_rank=r).node, Counter()).update(p.shard_sequence)
    return out


@SETTINGS
@given(counts_st, node_specs())
def test_exactly_once_and_equal_ranks(counts: list[int], spec: PlanSpec) -> None:
    """The single-node plan's properties (tests/test_plan.py) with several nodes, and in batched
    mode: equal ranks, whole batches per worker, exactly once."""
    check_exactly_once_and_equal_ranks(counts, replace(spec, batch_size=1))
    n, plans = sum(counts), all_plans(counts, spec)
    per_worker = {r: tuple(len(plans[r, w]) for w in range(spec.num_workers)) for r in range(spec.dp_size)}
    assert len(set(per_worker.values())) == 1, "ranks read different amounts"
    starts = np.concatenate([[0], np.cumsum(per_worker[0])[:-1]])
    assert all(a % spec.batch_size == 0 for a, k in zip(starts, per_worker[0]) if k), "a worker starts mid-batch"
    seen = Counter(np.concatenate([p.samples for p in plans.values()]).tolist())
    if spec.drop_last:
        assert all(v == 1 for v in seen.values()) and sum(per_worker[0]) % spec.batch_size == 0
    else:
        assert set(seen) == set(range(n)) and sum(seen.values()) == -(-n // spec.dp_size) * spec.dp_size


@SETTINGS
@given(counts_st, node_specs(), st.integers(1, 50))
def test_a_node_reads_the_same_shards_every_epoch(counts: list[int], spec: PlanSpec, later: int) -> None:
    """The shards (and, without drop_last, samples) of each node are fixed for the run."""
    spec = replace(spec, drop_last=False)
    a, b = node_reads(counts, spec), node_reads(counts, replace(spec, epoch=spec.epoch + later))
    assert {k: set(v) for k, v in a.items()} == {k: set(v) for k, v in b.items()}

    def samples(s: PlanSpec) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for (r, _), p in all_plans(counts, s).items():
            out.setdefault(replace(s, dp_rank=r).node, set()).update(p.samples.tolist())
        return out
    assert samples(spec) == samples(replace(spec, epoch=spec.epoch + later))


@SETTINGS
@given(st.lists(st.integers(5, 40), min_size=8, max_size=24), st.integers(0, 2**31 - 1), st.integers(0, 100))
def test_epochs_reshuffle_within_a_node(counts: list[int], seed: int, epoch: int) -> None:
    spec = PlanSpec(seed=seed, epoch=epoch, dp_size=2, num_nodes=2)
    one = [build_plan(np.array(counts), replace(spec, dp_rank=r)).samples for r in range(2)]
    two = [build_plan(np.array(counts), replace(spec, dp_rank=r, epoch=epoch + 1)).samples for r in range(2)]
    assert any(not np.array_equal(x, y) for x, y in zip(one, two))


@SETTINGS
@given(st.lists(st.integers(1, 100), min_size=1, max_size=300), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_assignment_balanced_and_sticky(sizes: list[int], nodes: int, seed: int) -> None:
    """Every node holds D/N to within one shard while each node's step is at least a shard; going
    N -> N+1 moves only the new node's share, and every other node keeps all it still owns."""
    s = np.array(sizes)
    a, b = assign_nodes(s, nodes, seed), assign_nodes(s, nodes + 1, seed)
    assert a.min() >= 0 and a.max() < nodes and b.max() <= nodes
    assert np.array_equal(a[b != nodes], b[b != nodes]), "a shard moved between surviving nodes"
    total = s.sum()
    if total / (nodes * (nodes + 1)) >= s.max():  # each join takes >= one shard from each node
        for owner, n in ((a, nodes), (b, nodes + 1)):
            loads = np.bincount(owner, weights=s, minlength=n)
            assert np.abs(loads - total / n).max() <= s.max() + 1e-9
        moved = s[a != b].sum()
        assert abs(moved - total / (nodes + 1)) <= s.max()


@pytest.mark.parametrize("old,new", [(4, 3), (3, 4), (8, 7), (64, 63), (63, 64)])
def test_elastic_change_figures(old: int, new: int) -> None:
    """The issue's figures on 4,096 shards of unequal size: >= 90 % kept, moved <= 1.1 D / max(N, M)."""
    sizes = np.random.default_rng(1).integers(48 << 20, 80 << 20, 4096)
    a, b = assign_nodes(sizes, old, 11), assign_nodes(sizes, new, 11)
    for k in range(min(old, new)):
        kept = sizes[(a == k) & (b == k)].sum() / min(sizes[a == k].sum(), sizes[b == k].sum())
        assert kept >= 0.999, (k, kept)
    assert sizes[a != b].sum() <= 1.1 * sizes.sum() / max(old, new)


def test_global_order_reshuffle_is_what_sticks_worse() -> None:
    """The issue's measurement: the share of a node's shards it did not hold the epoch before.
    Global placement (today's plan) at 8 nodes: ~0.88; node placement: 0."""
    counts = np.full(512, 10)

    def fresh(placement: str) -> float:
        spec = PlanSpec(seed=1, dp_size=8, num_nodes=8, placement=placement)
        fresh = []
        for r in range(8):
            e0 = set(build_plan(counts, replace(spec, dp_rank=r), shards_only=True).shard_sequence)
            e1 = set(build_plan(counts, replace(spec, dp_rank=r, epoch=1), shards_only=True).shard_sequence)
            fresh.append(len(e1 - e0) / len(e1))
        return float(np.mean(fresh))
    assert fresh("global") > 0.8
    assert fresh("node") == 0.0


@SETTINGS
@given(counts_st, st.integers(0, 2**31 - 1), st.integers(0, 100), st.integers(1, 4), st.booleans())
def test_one_node_and_global_placement_are_todays_plan(counts: list[int], seed: int, epoch: int, dp: int,
                                                       drop_last: bool) -> None:
    base = PlanSpec(seed=seed, epoch=epoch, dp_size=dp * 2, drop_last=drop_last, num_workers=2)
    for other in (replace(base, placement="global", num_nodes=2), replace(base, num_nodes=1)):
        for r in range(base.dp_size):
            for w in range(2):
                x = build_plan(np.array(counts), replace(base, dp_rank=r, worker_id=w))
                y = build_plan(np.array(counts), replace(other, dp_rank=r, worker_id=w))
                assert np.array_equal(x.samples, y.samples) and x.runs == y.runs and x.padded == y.padded


@st.composite
def consumed_for(draw: st.DrawFn, counts: list[int], spec: PlanSpec, order=None) -> list[int]:
    lengths = [len(build_plan(np.array(counts), replace(spec, worker_id=w), order=order, shards_only=True))
               for w in range(spec.num_workers)]
    return [draw(st.integers(0, n)) for n in lengths]


def read_by(counts: list[int], spec: PlanSpec, consumed: list[int], order=None) -> set[int]:
    read: set[int] = set()
    for (_, w), p in all_plans(counts, spec, order=order).items():
        read |= set(p.samples[:consumed[w]].tolist())
    return read


@SETTINGS
@given(st.data(), counts_st, node_specs(), st.integers(1, 4), st.integers(1, 3))
def test_elastic_resume_across_node_counts(data: st.DataObject, counts: list[int], spec: PlanSpec, nodes2: int,
                                           ranks2: int) -> None:
    """A mid-epoch resume on another node count (or global placement) reads every unread sample
    exactly once, and the resumed plan keeps exactly once and equal ranks."""
    spec = replace(spec, drop_last=False)
    c = np.array(counts)
    consumed = data.draw(consumed_for(counts, spec))
    rest = remainder_order(c, spec, consumed)
    read = read_by(counts, spec, consumed)
    assert len(set(rest.tolist())) == len(rest) and set(rest.tolist()) == set(range(sum(counts))) - read
    assume(len(rest) > 0)
    spec2 = replace(spec, num_nodes=nodes2, dp_size=nodes2 * ranks2, num_workers=data.draw(st.integers(1, 3)))
    plans = all_plans(counts, spec2, order=rest)
    got = Counter(np.concatenate([p.samples for p in plans.values()]).tolist())
    assert set(got) == set(rest.tolist())
    assert sum(v - 1 for v in got.values()) == plans[0, 0].padded < spec2.dp_size
    assert len({len(p) for (r, w), p in plans.items() if w == 0}) == 1
    # and a second resume from the first one's remainder
    consumed2 = data.draw(consumed_for(counts, spec2, order=rest))
    rest2 = remainder_order(c, spec2, consumed2, order=rest)
    read2 = read_by(counts, spec2, consumed2, order=rest)
    assert set(rest2.tolist()) == set(rest.tolist()) - read2 and len(set(rest2.tolist())) == len(rest2)


def test_node_count_must_divide_ranks() -> None:
    with pytest.raises(ValueError, match="num_nodes"):
        PlanSpec(dp_size=3, num_nodes=2)
    with pytest.raises(ValueError, match="placement"):
        PlanSpec(placement="nodes")
    assert not PlanSpec(dp_size=3, num_nodes=2, placement="global").node_placed


def test_resume_state_on_another_node_count_is_elastic() -> None:
    """Same dp_size and num_workers but another node count is another plan: the saved counts must
    not be skipped on it; the unread samples are planned afresh, each once."""
    from datacache.plan.resume import resume_plan, start_state

    counts = np.full(40, 25)
    spec = PlanSpec(seed=1, dp_size=4, num_workers=2, num_nodes=2)
    state = replace(start_state(epoch=0, seed=1, dataset_id="x", dp_size=4, dp_rank=0, num_workers=2, num_nodes=2),
                    consumed=(30, 20))
    state = type(state).from_dict(state.to_dict())  # through a checkpoint
    read = read_by(counts.tolist(), spec, [30, 20])
    got: list[int] = []
    for r in range(4):
        for w in range(2):
            sub = replace(spec, num_nodes=4, dp_rank=r, worker_id=w)
            order, skip = resume_plan(counts, sub, state)
            got += build_plan(counts, sub, order=order).samples[skip:].tolist()
    assert set(got) == set(range(1000)) - read and len(got) - len(set(got)) < 4


def _todays_piece(counts: np.ndarray, spec: PlanSpec, order: np.ndarray | None) -> tuple[np.ndarray, int]:
    """A consumer's unshuffled samples as the sample-level plan before shard-level orders computed
    them (one int64 per sample of the epoch), and the padded count: the oracle for one node."""
    offsets = np.concatenate([[0], np.cumsum(counts)])
    if order is None:
        shards = np.arange(len(counts))
        if spec.shuffle:
            shards = np.random.default_rng([spec.seed, spec.epoch, 0]).permutation(len(counts))
        order = np.concatenate([np.arange(offsets[s], offsets[s + 1]) for s in shards])
    pieces, padded = split_even(order, spec.dp_size, spec.drop_last, spec.batch_size)
    rank, b = pieces[spec.dp_rank], spec.batch_size
    bounds = np.linspace(0, -(-len(rank) // b), spec.num_workers + 1).round().astype(np.int64) * b
    mine = rank[bounds[spec.worker_id]:bounds[spec.worker_id + 1]]
    if spec.shuffle and len(mine):  # the largest of the last `window` runs (not the first) goes last
        shard = np.searchsorted(offsets, mine, side="right") - 1
        runs = np.split(mine, np.flatnonzero(np.diff(shard)) + 1)
        candidates = range(max(1, len(runs) - spec.window), len(runs))
        if len(candidates) > 1:
            pick = max(candidates, key=lambda i: (len(runs[i]), i))
            mine = np.concatenate(runs[:pick] + runs[pick + 1:] + [runs[pick]])
    return mine, padded


@SETTINGS
@given(st.data(), counts_st, node_specs())
def test_shard_level_orders_equal_the_sample_level_plan(data: st.DataObject, counts: list[int],
                                                        spec: PlanSpec) -> None:
    """One node (or placement="global"): the shard-level order gives today's plan, run for run."""
    c = np.array(counts)
    spec = replace(spec, placement="global", batch_size=data.draw(st.integers(1, 4)))
    order = None
    if data.draw(st.booleans()):  # a resume's remainder: any subset, grouped by shard
        order = np.array(sorted(data.draw(st.sets(st.integers(0, sum(counts) - 1), min_size=1))))
    for r in range(spec.dp_size):
        for w in range(spec.num_workers):
            sub = replace(spec, dp_rank=r, worker_id=w)
            piece, padded = _todays_piece(c, sub, order)
            run_of, starts, runs = piece_runs(piece, np.concatenate([[0], np.cumsum(c)]))
            for plan in (build_plan(c, sub, order=order), build_plan(c, sub, order=order, shards_only=True)):
                assert plan.runs == runs and np.array_equal(plan.run_starts, starts) and plan.padded == padded
                assert len(plan) == len(piece)
            plan = build_plan(c, sub, order=order)
            for i in range(len(runs)):
                assert sorted(plan.samples[plan.run_of == i].tolist()) == sorted(piece[run_of == i].tolist())


@SETTINGS
@given(st.lists(st.integers(50, 100), min_size=24, max_size=60), st.integers(2, 6), st.integers(1, 3),
       st.integers(0, 2**31 - 1), st.booleans())
def test_a_node_reads_few_shards_of_other_nodes(counts: list[int], nodes: int, ranks: int, seed: int,
                                                drop_last: bool) -> None:
    """The samples that balance the nodes come as at most two partial shards of other nodes."""
    spec = PlanSpec(seed=seed, dp_size=nodes * ranks, num_nodes=nodes, drop_last=drop_last, num_workers=2)
    owner = assign_nodes(np.array(counts), nodes, seed)
    for node, shards in node_reads(counts, spec).items():
        foreign = {s for s in shards if owner[s] != node}
        assert len(foreign) <= 2, (node, foreign)
