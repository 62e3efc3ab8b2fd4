"""Checks of the epoch plan shared by tests/test_plan.py and tests/test_node_plan.py."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from datacache.plan.epoch import PlanSpec, build_plan

__all__ = ["all_plans", "check_exactly_once_and_equal_ranks", "SETTINGS", "counts_st", "node_specs"]

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

counts_st = st.lists(st.integers(0, 40), min_size=1, max_size=24).filter(lambda c: sum(c) >= 1)


@st.composite
def node_specs(draw: st.DrawFn) -> PlanSpec:
    nodes = draw(st.integers(2, 4))
    return PlanSpec(seed=draw(st.integers(0, 2**31 - 1)), epoch=draw(st.integers(0, 1000)),
                    shuffle=draw(st.booleans()), window=draw(st.integers(1, 5)), drop_last=draw(st.booleans()),
                    dp_size=nodes * draw(st.integers(1, 3)), num_workers=draw(st.integers(1, 3)), num_nodes=nodes,
                    batch_size=draw(st.sampled_from([1, 1, 2, 3])), mix_bytes=draw(st.sampled_from([0, 0, 1 << 40])),
                    chunk_bytes=draw(st.integers(1, 40)))


def all_plans(counts: list[int], spec: PlanSpec, **kw):
    """{(rank, worker): plan} for every consumer of the epoch."""
    return {(r, w): build_plan(np.array(counts), replace(spec, dp_rank=r, worker_id=w), **kw)
            for r in range(spec.dp_size) for w in range(spec.num_workers)}


def check_exactly_once_and_equal_ranks(counts: list[int], spec: PlanSpec) -> None:
    """Every sample once per epoch (plus ``padded`` repeats), equal ranks, equal worker splits."""
    n = sum(counts)
    plans = all_plans(counts, spec)
    everything = np.concatenate([p.samples for p in plans.values()])
    seen = Counter(everything.tolist())
    padded = plans[0, 0].padded
    assert all(p.padded == padded for p in plans.values())
    assert all(len(p) == len(p.samples) for p in plans.values())
    if spec.drop_last:
        assert padded == 0
        assert all(v == 1 for v in seen.values()), "a sample repeats with drop_last=True"
        assert len(everything) == (n // spec.dp_size) * spec.dp_size
        assert set(seen) <= set(range(n))
    else:
        assert set(seen) == set(range(n)), "some sample is never read"
        assert len(everything) == n + padded
        assert sum(c - 1 for c in seen.values()) == padded
        assert 0 <= padded < spec.dp_size
    # every rank reads the same number of samples, and its workers the same split
    per_worker = {r: [len(plans[r, w]) for w in range(spec.num_workers)] for r in range(spec.dp_size)}
    assert len({sum(v) for v in per_worker.values()}) == 1
    assert len({tuple(v) for v in per_worker.values()}) == 1
    sizes = per_worker[0]
    assert max(sizes) - min(sizes) <= 1
    # hence equal batch counts for any batch size when each worker's stream is batched on its own
    for b in range(1, 10):
        batches = {sum(-(-k // b) for k in per_worker[r]) for r in range(spec.dp_size)}
        assert len(batches) == 1, f"ranks yield different batch counts at batch size {b}"

