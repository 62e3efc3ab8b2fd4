"""Resuming StreamingDataset: exact order at any midpoint, across epochs, elastic N -> M world
sizes, and through torchdata's StatefulDataLoader. All checks go through tests.helpers.resume:
each property is checked with states saved in the main process and with states saved in
DataLoader workers (StatefulDataLoader, 2 workers) and by several ranks (issue 17.5)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from datacache import NodeCache, StreamingDataset, write_dataset
from tests.helpers.resume import Stage, check_exactly_once, check_resume

N = 400


@pytest.fixture(scope="module")
def dataset_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"file://{tmp_path_factory.mktemp('resume')}/ds"
    m = write_dataset(({"i": i, "x": np.full(4, i, dtype=np.int32)} for i in range(N)), url,
                      shard_bytes=2000, progress=False)
    assert 8 <= len(m.shards) <= 14 and len({s.samples for s in m.shards}) > 1  # uneven last shard
    return url


def factory(url: str, cache: NodeCache, **kw: Any):
    def make_ds(dp_rank: int = 0, dp_size: int = 1) -> StreamingDataset:
        return StreamingDataset(url, cache=cache, seed=3, dp_rank=dp_rank, dp_size=dp_size, **kw)
    return make_ds


def workers(batch_size: int | None = 8):
    """The loader that saves in its DataLoader workers: StatefulDataLoader with 2 workers."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    return lambda ds: StatefulDataLoader(ds, num_workers=2, batch_size=batch_size)


SAVED_IN = ["main", "workers"]


@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_single_process_midpoints(dataset_url: str, cache: NodeCache, shuffle: bool) -> None:
    ref = check_resume(factory(dataset_url, cache, shuffle=shuffle), [0, 1, N // 2, 137, N - 1, N, (150, 0, 1, 100)],
                       epoch=2)
    assert sorted(ref) == list(range(N))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved_in", SAVED_IN)
def test_resume_small_window(dataset_url: str, cache: NodeCache, saved_in: str) -> None:
    if saved_in == "main":
        check_resume(factory(dataset_url, cache, window=1), [1, 39, 250, N - 1])
    else:  # in batches of 8 (50 of them), from the workers
        check_resume(factory(dataset_url, cache, window=1), [1, 5, 31, 49], make_loader=workers())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved_in", SAVED_IN)
def test_resume_batched_dataset(dataset_url: str, cache: NodeCache, saved_in: str) -> None:
    loader = None if saved_in == "main" else workers(batch_size=None)
    ref = check_resume(factory(dataset_url, cache, batch_size=8), [0, 3, 49, 50, (2, 1, 30)], make_loader=loader)
    assert len(ref) == 50 and sorted(i for b in ref for i in b) == list(range(N))


def test_resume_into_next_epoch(dataset_url: str, cache: NodeCache) -> None:
    # saved at the end of epoch 0: the new dataset continues with epoch 1 after set_epoch(1)
    check_resume(factory(dataset_url, cache), [N], epoch=0, then_epoch=1)
    # saved mid-epoch 0 but the loop moves on to epoch 1: epoch 1 is read whole
    check_resume(factory(dataset_url, cache), [100], epoch=0, then_epoch=1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved_in", SAVED_IN)
def test_resume_keeps_rank(dataset_url: str, cache: NodeCache, saved_in: str) -> None:
    make = factory(dataset_url, cache)
    if saved_in == "main":
        check_resume(lambda **_: make(dp_rank=1, dp_size=3), [0, 66, 133])
    else:  # 134 samples of rank 1 in batches of 8: 17 batches
        check_resume(lambda **_: make(dp_rank=1, dp_size=3), [0, 8, 16, (3, 1, 5)], make_loader=workers())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("saved_in", SAVED_IN)
@pytest.mark.parametrize("world", [(2, 3), (3, 2), (4, 1), (1, 2), (2, 3, 4)])
def test_resume_elastic(dataset_url: str, cache: NodeCache, world: tuple[int, ...], saved_in: str) -> None:
    if saved_in == "main":  # the ranks iterate their datasets; rank 0's state is resumed
        reads = [37, 21][: len(world) - 1]
        seen = check_resume(factory(dataset_url, cache), reads, world=world, epoch=1)
    else:  # every rank reads through 2 workers, saves its loader's state; all of them are resumed
        stages = [Stage(size, 2, batches) for size, batches in zip(world[:-1], (4, 2))] + [Stage(world[-1], 2)]
        seen = check_exactly_once(factory(dataset_url, cache), stages, epoch=1, loader_batch=8)
    # every sample once, plus the last plan's padding (counted exactly by the helpers)
    assert set(seen) == set(range(N)) and len(seen) - N < world[-1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved_in", SAVED_IN)
def test_resume_elastic_into_dataloader_workers(dataset_url: str, cache: NodeCache, saved_in: str) -> None:
    """A 3-rank state resumed by 2 ranks that each read through 2 DataLoader workers."""
    from torch.utils.data import DataLoader

    if saved_in == "main":
        seen = check_resume(factory(dataset_url, cache), [45], world=(3, 2), epoch=0,
                            make_loader=lambda ds: DataLoader(ds, batch_size=None, num_workers=2))
    else:  # saved by 3 ranks in their workers after 3 batches of 8
        seen = check_exactly_once(factory(dataset_url, cache), [Stage(3, 2, 3), Stage(2, 2)], loader_batch=8)
    assert set(seen) == set(range(N)) and len(seen) - N < 2


@pytest.mark.timeout(120)
def test_resume_elastic_then_same_world_from_workers(dataset_url: str, cache: NodeCache) -> None:
    """As below, saved in DataLoader workers: 2 ranks -> 1 rank (elastic) -> the same layout,
    resumed from its own loader state; exactly once only if the elastic chain is kept."""
    check_exactly_once(factory(dataset_url, cache), [Stage(2, 2, 3), Stage(1, 2, 6), Stage(1, 2, load="loader")],
                       loader_batch=8)


def test_resume_elastic_then_same_world(dataset_url: str, cache: NodeCache) -> None:
    """An elastic resume followed by a plain (same world) resume: the chain is kept."""
    make = factory(dataset_url, cache)
    before = []
    olds = [make(dp_rank=r, dp_size=2) for r in range(2)]
    for ds in olds:
        it = iter(ds)
        before += [int(next(it)["i"]) for _ in range(50)]
    state = olds[0].state_dict()
    mid = make(dp_rank=0, dp_size=1)
    mid.load_state_dict(state)
    it = iter(mid)
    middle = [int(next(it)["i"]) for _ in range(120)]
    state2 = mid.state_dict()
    assert state2["chain"], "an elastic resume must be recorded in the state"
    resumed = make(dp_rank=0, dp_size=1)
    resumed.load_state_dict(state2)
    rest = [int(s["i"]) for s in resumed]
    assert rest == [int(s["i"]) for s in it], "resuming an elastic resume must continue its exact order"
    assert sorted(before + middle + rest) == list(range(N))


def test_state_dict_rejects_other_dataset_or_seed(dataset_url: str, cache: NodeCache) -> None:
    ds = factory(dataset_url, cache)()
    state = ds.state_dict()
    other = StreamingDataset(dataset_url, cache=cache, seed=4)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="another dataset"):
        ds.load_state_dict({**state, "dataset_id": "ds-0000"})


@pytest.mark.timeout(120)
def test_resume_stateful_dataloader(dataset_url: str, cache: NodeCache) -> None:
    loader = workers()
    # 400 samples -> 200 per worker -> 25 batches each, interleaved. (3, 1, 20): resumed twice, the
    # second time after one batch, i.e. before the other worker delivered a batch since the resume
    ref = check_resume(factory(dataset_url, cache), [0, 7, 50, (3, 1, 20)], make_loader=loader)
    assert len(ref) == 50 and sorted(i for b in ref for i in b) == list(range(N))
    # saved at the end of epoch 0 (or mid-epoch), resumed with set_epoch(1): the workers' epoch-0
    # states must not replace the epoch the training loop selected
    check_resume(factory(dataset_url, cache), [50, 20], then_epoch=1, make_loader=loader)
