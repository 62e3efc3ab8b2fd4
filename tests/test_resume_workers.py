"""Resuming from states saved in DataLoader workers (torchdata's StatefulDataLoader) and by several
ranks: resumed with the same / fewer / more ranks and the same / other num_workers, in samples and
batched mode, every sample exactly once (issue 11, point 1). All checks count every read
(tests.helpers.resume.check_exactly_once); the state object itself is checked in test_resume_state_*."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from datacache import NodeCache, StreamingDataset, write_dataset
from datacache.plan.epoch import build_plan
from datacache.plan.part_shuffle import NARROW_ROWS
from datacache.plan.resume import ResumeState, common_state, rank_state
from tests.helpers.resume import Stage, check_exactly_once

N = 400
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def dataset_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"file://{tmp_path_factory.mktemp('resume-workers')}/ds"
    write_dataset(({"i": i, "x": np.full(4, i, dtype=np.int32)} for i in range(N)), url,
                  shard_bytes=2000, progress=False)
    return url


def factory(url: str, cache: NodeCache, **kw: Any):
    def make_ds(dp_rank: int = 0, dp_size: int = 1) -> StreamingDataset:
        return StreamingDataset(url, cache=cache, seed=5, dp_rank=dp_rank, dp_size=dp_size, **kw)
    return make_ds


# 2 ranks x 2 workers save after 5 batches of 8 (40 samples per rank, 20 per worker; a worker holds
# 100 samples), as in the issue: resumed on 1 rank gave 300 duplicates there, on 3 ranks loading
# rank r % 2's state 451 duplicates and 150 missing.
SAVED = Stage(2, 2, 5)
SAMPLE_STAGES = {
    "fewer-ranks": [SAVED, Stage(1, 2)],
    "same-layout-into-dataset": [SAVED, Stage(2, 2)],
    "more-ranks-mod": [SAVED, Stage(3, 2, load="mod")],
    "more-workers": [SAVED, Stage(2, 3)],
    "main-process": [SAVED, Stage(2, 0)],
    "same-then-elastic": [SAVED, Stage(2, 2, 3, load="loader"), Stage(3, 1)],
    "main-into-workers": [Stage(1, 0, 9), Stage(2, 2)],
    "dataset-into-workers": [Stage(2, None, 30), Stage(3, 2)],
    "three-layouts": [SAVED, Stage(3, 3, 2, load="mod"), Stage(1, 2)],
}


@pytest.mark.parametrize("name", list(SAMPLE_STAGES))
def test_exactly_once_from_workers(dataset_url: str, cache: NodeCache, name: str) -> None:
    check_exactly_once(factory(dataset_url, cache), SAMPLE_STAGES[name], epoch=1, loader_batch=8)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("reads", [0, 1, 13, 24])  # of 25 batches per rank: before any, ..., the last but one
def test_exactly_once_at_midpoints(dataset_url: str, cache: NodeCache, reads: int, batched: bool) -> None:
    make = factory(dataset_url, cache, batch_size=8 if batched else None)
    check_exactly_once(make, [Stage(2, 2, reads), Stage(3, 1)], loader_batch=None if batched else 8)


@pytest.mark.parametrize("reads", [1, 13])
def test_exactly_once_at_midpoints_of_a_part_mix(dataset_url: str, cache: NodeCache, reads: int) -> None:
    """A cold epoch read as a part mix (the default: its order dealt across the node's
    consumers in node time) saved mid-epoch by 2 ranks x 2 workers and resumed on 3 ranks x 1
    worker: every sample once. The resumed plan is the part mix the state recorded, whatever the
    cache holds by then."""
    make = factory(dataset_url, cache, batch_size=8)
    assert make()._spec(2, 0).part_bytes > 0  # the epoch is a part mix
    check_exactly_once(make, [Stage(2, 2, reads), Stage(3, 1)])


@pytest.fixture(scope="module")
def large_parts_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """9,000 samples in 129 shards of about 70, one block each: 129 parts of about 70 samples,
    enough parts and samples a part for a part mix's window to narrow at the end
    (``datacache.plan.epoch.part_shuffle.NARROW_ROWS``)."""
    url = f"file://{tmp_path_factory.mktemp('resume-large-parts')}/ds"
    write_dataset(({"i": i, "x": np.full(4, i, dtype=np.int32)} for i in range(9000)), url,
                  shard_bytes=3700, progress=False)
    return url


@pytest.mark.parametrize("reads", [3, 40])
def test_exactly_once_at_midpoints_of_a_narrowing_part_mix(large_parts_url: str, cache: NodeCache,
                                                           reads: int) -> None:
    """As above, on parts large enough for the window to narrow over the epoch's end
    (``PlanSpec.part_narrow``) and read in strata (``PlanSpec.part_strata``), both of which the
    state records: saved by 2 ranks x 2 workers, resumed on 3 ranks x 1 worker, every sample once."""
    make = factory(large_parts_url, cache, batch_size=8)
    ds = make()
    spec = ds._spec(2, 0)
    assert spec.part_narrow > 0 and spec.part_strata > 0
    assert min(s.samples for s in ds.manifest.shards[:-1]) >= NARROW_ROWS
    planned = build_plan(ds.counts, spec).samples
    for without in ({"part_narrow": 0}, {"part_strata": 0}):
        assert not np.array_equal(planned, build_plan(ds.counts, replace(spec, **without)).samples)
    check_exactly_once(make, [Stage(2, 2, reads), Stage(3, 1)])


BATCHED_STAGES = {
    "fewer-ranks": [SAVED, Stage(1, 2)],
    "more-ranks-fewer-workers": [SAVED, Stage(3, 1, load="mod")],
    "same-then-more-workers": [SAVED, Stage(2, 2, 2, load="loader"), Stage(2, 4)],
}


@pytest.mark.parametrize("name", list(BATCHED_STAGES))
def test_exactly_once_from_workers_batched(dataset_url: str, cache: NodeCache, name: str) -> None:
    check_exactly_once(factory(dataset_url, cache, batch_size=8), BATCHED_STAGES[name], epoch=0)


@pytest.mark.parametrize("new", [Stage(2, 3, load="loader"), Stage(2, 1, load="loader"),
                                 Stage(1, 2, load="loader")])
def test_loader_state_into_another_layout_is_refused(dataset_url: str, cache: NodeCache, new: Stage) -> None:
    """A worker's own state cannot place the other workers: loading the old loader state into a
    loader of another layout raises a clear error (was: AssertionError inside torchdata for another
    num_workers, duplicates for another world size)."""
    with pytest.raises(ValueError, match="needs every worker's"):
        check_exactly_once(factory(dataset_url, cache), [SAVED, new], loader_batch=8)


def test_state_dict_in_main_process_while_workers_iterate(dataset_url: str, cache: NodeCache) -> None:
    from torch.utils.data import DataLoader

    ds = factory(dataset_url, cache)()
    it = iter(DataLoader(ds, batch_size=8, num_workers=2))
    next(it)
    with pytest.raises(RuntimeError, match="StatefulDataLoader"):
        ds.state_dict()  # was: silently {"consumed": [0], ...}
    del it
    ds.close()


def _loader_states(make_ds: Any, reads: list[int | None], seen: list[int],
                   load: list[Any] | None = None) -> list[dict[str, Any]]:
    """Rank r of len(reads) reads reads[r] batches (None: all) through StatefulDataLoader(num_workers=2),
    from its own state in ``load`` if given; returns the loader states, appends the ids to ``seen``."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    states = []
    for r, k in enumerate(reads):
        ds = make_ds(dp_rank=r, dp_size=len(reads))
        loader = StatefulDataLoader(ds, num_workers=2, batch_size=8)
        if load is not None:
            loader.load_state_dict(load[r])
        it = iter(loader)
        for batch in (it if k is None else (next(it) for _ in range(k))):
            seen += batch["i"].tolist()
        states.append(loader.state_dict())
        del it
        ds.close()
    return states


def test_ranks_at_different_steps_resume_their_own_states(dataset_url: str, cache: NodeCache) -> None:
    """With the same layout each rank continues from its own state, in lockstep or not."""
    make, seen = factory(dataset_url, cache), []
    states = _loader_states(make, [4, 7], seen)
    _loader_states(make, [None, None], seen, load=states)
    assert sorted(seen) == list(range(N))


def test_rank_states_that_disagree_are_refused(dataset_url: str, cache: NodeCache) -> None:
    """Ranks that saved at different steps cannot all be resumed from one rank's counts."""
    make = factory(dataset_url, cache)
    states = _loader_states(make, [4, 5], [])
    merged = [rank_state(s) for s in states]
    assert merged[0].consumed == (16, 16) and merged[1].consumed == (24, 16)  # delivered, not read ahead
    with pytest.raises(ValueError, match="disagree"):
        make().load_state_dict(states)


def test_snapshot_interval_is_refused(dataset_url: str, cache: NodeCache) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = factory(dataset_url, cache)()
    loader = StatefulDataLoader(ds, num_workers=2, batch_size=8, snapshot_every_n_steps=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    ds.close()
    with pytest.raises(ValueError, match="snapshot_every_n_steps=1"):
        rank_state(state)


def test_resume_state_round_trip() -> None:
    st = ResumeState(epoch=2, seed=5, dataset_id="ds-1", dp_size=2, dp_rank=1, num_workers=3,
                     consumed=(4, None, 7), chain=())
    assert ResumeState.from_dict(st.to_dict()) == st
    assert not st.complete and ResumeState.from_dict({**st.to_dict(), "consumed": [4, 5, 7]}).complete
    with pytest.raises(ValueError, match="needs every worker's"):
        st.check_layout(1, 3)
    st.check_layout(2, 3)  # the same layout needs only the consumer's own count
    # a version-1 state saved in worker 1 of 2 wrote 0 for worker 0, which it did not know
    v1 = {"version": 1, "epoch": 0, "seed": 5, "dataset_id": "ds-1", "dp_size": 2, "num_workers": 2,
          "worker_id": 1, "consumed": [0, 9], "chain": []}
    assert ResumeState.from_dict(v1).consumed == (None, 9)
    for bad in ({**st.to_dict(), "consumed": [1, 2]}, {**st.to_dict(), "epoch": -1}, {**st.to_dict(), "dp_rank": 2},
                {**st.to_dict(), "version": 9}, {"version": 2}, [1, 2],
                {**st.to_dict(), "chain": [{"dp_size": 2, "num_workers": 1, "consumed": [None]}]}):
        with pytest.raises(ValueError):
            ResumeState.from_dict(bad)  # type: ignore[arg-type]
    assert common_state([st.to_dict(), {**st.to_dict(), "dp_rank": 0}]).dp_rank is None
