"""``datacache.DataLoader`` (issue 15, point 6): torch's signature; over a StreamingDataset
``batch_size=B`` becomes the dataset's batched mode (the loader below gets ``batch_size=None``),
so the line users write first is the fast one; resumable like ``StatefulDataLoader``; a plain
torch ``DataLoader(ds, batch_size=B)`` still works; anything else is torch's ``DataLoader``."""
from __future__ import annotations

import gc
import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import default_collate

import datacache
from datacache import NodeCache, StreamingDataset, write_dataset
from datacache.pytorch.batches import collate
from tests.helpers.resume import Stage, check_exactly_once, check_resume

N = 500
pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    u = f"file://{tmp_path_factory.mktemp('loader')}/ds"
    write_dataset(({"i": i, "x": np.full(4, i, np.int32)} for i in range(N)), u, shard_bytes=3000, progress=False)
    return u


def ids_of(batch: dict[str, Any]) -> list[int]:
    assert isinstance(batch["i"], torch.Tensor) and batch["i"].dtype == torch.int64
    assert batch["x"].dtype == torch.int32 and batch["x"].shape == (len(batch["i"]), 4)
    assert torch.equal(batch["x"][:, 0].long(), batch["i"]), "batch fields are misaligned"
    return batch["i"].tolist()


def ids_only(samples: list[dict[str, Any]]) -> list[int]:
    """A custom collate_fn (module level: DataLoader workers unpickle it)."""
    return [int(s["i"]) for s in samples]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_batch_size_becomes_the_datasets_batched_mode(url: str, cache: NodeCache, workers: int,
                                                      drop_last: bool) -> None:
    ds = StreamingDataset(url, cache=cache, seed=3)
    loader = datacache.DataLoader(ds, batch_size=32, num_workers=workers, drop_last=drop_last,
                                  persistent_workers=workers > 0)
    assert loader.dataset is ds and ds.batch_size == 32 and loader.batch_size is None  # torch does not batch again
    assert ds.drop_last is drop_last
    assert len(loader) == (N // 32 if drop_last else -(-N // 32))
    for epoch in range(2):
        ds.set_epoch(epoch)
        batches = [ids_of(b) for b in loader]
        assert len(batches) == len(loader), f"epoch {epoch}: {len(batches)} batches, len() said {len(loader)}"
        ids = [i for b in batches for i in b]
        if drop_last:
            assert all(len(b) == 32 for b in batches) and len(set(ids)) == len(ids) == N // 32 * 32
        else:
            assert sorted(ids) == list(range(N))
            assert sorted(map(len, batches))[1:] == [32] * (len(batches) - 1), "more than one short batch"
    del loader
    ds.close()


def test_batches_have_what_torchs_loader_gives(url: str, cache: NodeCache) -> None:
    """Same structure, dtypes and values per batch as torch's loader collating the same samples."""
    ds = StreamingDataset(url, cache=cache, shuffle=False)
    ours = list(datacache.DataLoader(ds, batch_size=50))
    ds.close()
    ds = StreamingDataset(url, cache=cache, shuffle=False)
    theirs = list(TorchDataLoader(ds, batch_size=50))  # samples mode: torch's per-sample path, as today
    ds.close()
    assert len(ours) == len(theirs) == N // 50
    for a, b in zip(ours, theirs):
        assert list(a) == list(b)
        for k in b:
            assert type(a[k]) is type(b[k]) and a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("ahead", [False, True])
def test_under_a_profiler_each_batch_is_a_dataloader_range(url: str, cache: NodeCache, ahead: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a profiler the loader skips torch's per-batch profiler range (it costs the training
    loop 0.1-0.25 ms a batch); under one every batch still shows as torch's DataLoader range, and
    the batches are the same either way (``ahead``: read ahead whenever there is no profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from datacache.pytorch import loader as loader_module

    if ahead:
        monkeypatch.setattr(loader_module, "_AHEAD_AFTER", 0.0)

    ds = StreamingDataset(url, cache=cache, seed=5)
    ds.set_epoch(0)  # both iterations: without set_epoch, the second would read epoch 1
    loader = datacache.DataLoader(ds, batch_size=64, num_workers=2)
    plain = [ids_of(b) for b in loader]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = [ids_of(b) for b in loader]
    ds.close()
    assert profiled == plain and len(plain) == len(loader)
    ranges = [e for e in prof.events() if e.name.startswith("enumerate(DataLoader)#")]
    assert len(ranges) >= len(plain), f"{len(ranges)} DataLoader ranges for {len(plain)} batches"


def test_default_batch_size_is_batches_of_one_and_none_is_samples(url: str, cache: NodeCache) -> None:
    ds = StreamingDataset(url, cache=cache, shuffle=False)
    first = next(iter(datacache.DataLoader(ds)))  # torch's default batch_size=1
    assert ds.batch_size == 1 and first["i"].shape == (1,) and first["x"].shape == (1, 4)
    ds.close()
    ds = StreamingDataset(url, cache=cache, shuffle=False)
    first = next(iter(datacache.DataLoader(ds, batch_size=None)))
    assert ds.batch_size is None and int(first["i"]) == 0 and first["x"].shape == (4,)
    ds.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_in_batched_mode_keeps_its_size(url: str, cache: NodeCache, workers: int) -> None:
    ds = StreamingDataset(url, cache=cache, batch_size=16)
    batches = [ids_of(b) for b in datacache.DataLoader(ds, num_workers=workers)]  # the form
    assert sorted(map(len, batches))[1:] == [16] * (len(batches) - 1)
    assert sorted(i for b in batches for i in b) == list(range(N))
    with pytest.raises(ValueError, match=r"batch_size=32, but the dataset already yields batches of 16"):
        datacache.DataLoader(ds, batch_size=32)
    assert len(list(datacache.DataLoader(ds, batch_size=16))) == len(ds)  # the same size is accepted
    ds.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_collate_fn_runs_in_the_dataset(url: str, cache: NodeCache, workers: int) -> None:
    ds = StreamingDataset(url, cache=cache)
    batches = list(datacache.DataLoader(ds, batch_size=20, collate_fn=ids_only, num_workers=workers))
    assert ds.collate_fn is ids_only and all(isinstance(b, list) and len(b) == 20 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(N))
    ds.close()
    ds = StreamingDataset(url, cache=cache)
    datacache.DataLoader(ds, batch_size=20, collate_fn=default_collate)  # torch's: the ring path gives the same
    assert ds.collate_fn is collate
    ds.close()


def _mark_started(folder: str, worker_id: int) -> None:
    import signal

    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with open(f"{folder}/worker-{worker_id}", "w") as f:
        f.write(f"sigint blocked: {blocked}")


@pytest.mark.subprocess
def test_a_worker_init_fn_runs_in_each_worker_with_ctrl_c_unblocked(url: str, cache: NodeCache,
                                                                    tmp_path: Any) -> None:
    """The loader forks its workers with SIGINT blocked and unblocks it before the user's
    ``worker_init_fn`` (tests/test_stop.py has the Ctrl-C itself); the training process's mask
    is as it was."""
    import functools
    import signal

    ds = StreamingDataset(url, cache=cache)
    loader = datacache.DataLoader(ds, batch_size=50, num_workers=2,
                                  worker_init_fn=functools.partial(_mark_started, str(tmp_path)))
    assert sum(len(b["i"]) for b in loader) == N and loader.worker_init_fn.func is _mark_started
    assert sorted(p.read_text() for p in tmp_path.glob("worker-*")) == ["sigint blocked: False"] * 2
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    ds.close()


@pytest.mark.parametrize("bad, match", [({"shuffle": True}, "shuffle= is not supported"),
                                        ({"sampler": [0, 1]}, "sampler= is not supported"),
                                        ({"batch_size": 0}, "batch_size must be a positive int"),
                                        ({"batch_size": None, "collate_fn": ids_only},
                                         "collate_fn= needs a batch_size"),
                                        ({"in_order": False}, "in_order=False is not supported")])
def test_what_cannot_apply_is_refused_in_one_line(url: str, cache: NodeCache, bad: dict[str, Any],
                                                  match: str) -> None:
    ds = StreamingDataset(url, cache=cache)
    with pytest.raises(ValueError, match=match):
        datacache.DataLoader(ds, **bad)
    assert ds.batch_size is None  # refused before the dataset was touched
    ds.close()


def test_plain_torch_dataloader_over_samples_still_works(url: str, cache: NodeCache) -> None:
    ds = StreamingDataset(url, cache=cache, seed=4)
    seen = Counter(i for b in TorchDataLoader(ds, batch_size=32, num_workers=2) for i in ids_of(b))
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
    ds.close()


def test_any_other_dataset_is_torchs_dataloader() -> None:
    loader = datacache.DataLoader(list(range(10)), batch_size=4, shuffle=False)
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    again = datacache.DataLoader(list(range(10)), batch_size=4)
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == [[4, 5, 6, 7], [8, 9]]


def _written(batch: Any) -> list[int]:
    return ids_of(batch) if isinstance(batch["i"], torch.Tensor) and batch["i"].dim() else [int(batch["i"])]


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers on 2 cores
@pytest.mark.parametrize("workers, batch_size", [(0, 32), (1, 32), (2, 32), (3, 32), (3, 7), (2, None)])
def test_unshuffled_batches_come_in_the_written_order(url: str, cache: NodeCache, workers: int,
                                                      batch_size: int | None) -> None:
    """Issue 37 point 6: ``shuffle=False`` through ``datacache.DataLoader`` gives the written order
    for any ``num_workers`` (each worker is dealt every ``num_workers``-th batch, as torch takes
    them), also on another rank (its contiguous part), and resumed mid-epoch, with the same or
    another number of workers."""
    ds = StreamingDataset(url, cache=cache, shuffle=False)
    loader = datacache.DataLoader(ds, batch_size=batch_size, num_workers=workers)
    assert [i for b in loader for i in _written(b)] == list(range(N))
    it = iter(loader)
    head = [i for _ in range(5) for i in _written(next(it))]
    state = loader.state_dict()
    del it
    ds.close()
    for resumed_workers in {workers, 2}:
        ds = StreamingDataset(url, cache=cache, shuffle=False)
        again = datacache.DataLoader(ds, batch_size=batch_size, num_workers=resumed_workers)
        again.load_state_dict(state)
        assert head + [i for b in again for i in _written(b)] == list(range(N)), f"resumed with {resumed_workers}"
        ds.close()
    ds = StreamingDataset(url, cache=cache, shuffle=False, dp_rank=1, dp_size=2)
    assert [i for b in datacache.DataLoader(ds, batch_size=batch_size, num_workers=workers)
            for i in _written(b)] == list(range(N // 2, N))
    ds.close()


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers on 2 cores
@pytest.mark.parametrize("workers", [2, 3])
def test_unshuffled_samples_batched_by_torch_come_in_the_written_order(url: str, cache: NodeCache,
                                                                       workers: int) -> None:
    """The same through torch's own ``DataLoader(batch_size=32)`` over samples mode: the workers
    are dealt turns of the 32 samples torch batches from one worker at a time."""
    ds = StreamingDataset(url, cache=cache, shuffle=False)
    assert [i for b in TorchDataLoader(ds, batch_size=32, num_workers=workers) for i in ids_of(b)] == list(range(N))
    ds.close()


def test_an_unshuffled_state_saved_before_turns_resumes_its_contiguous_shares(url: str, cache: NodeCache) -> None:
    """A state saved before unshuffled batches were dealt in turn (its ``mix`` has five fields)
    resumes the plan it was read with: two workers with 8 contiguous batches each, the first
    having delivered 2 batches (samples 0-63), the second 1 (256-287)."""
    ds = StreamingDataset(url, cache=cache, shuffle=False)
    loader = datacache.DataLoader(ds, batch_size=32, num_workers=2)
    old = {**loader.state_dict(), "consumed": [64, 32], "next_worker": 1}
    old["mix"] = old["mix"][:5]
    loader.load_state_dict(old)
    rest = [i for b in loader for i in ids_of(b)]
    assert sorted(rest + list(range(64)) + list(range(256, 288))) == list(range(N))
    assert rest[:32] == list(range(288, 320)) and rest[32:64] == list(range(64, 96))  # worker 1's turn next
    ds.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_creating_and_iterating_it_warns_nothing(url: str, cache: NodeCache, workers: int) -> None:
    """torchdata's constructor calls torch's deprecated ``set_vital`` (a UserWarning on every
    loader created, issue 37 point 14): datacache's loader shows the user none of it."""
    ds = StreamingDataset(url, cache=cache, shuffle=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaders = [datacache.DataLoader(ds, batch_size=50, num_workers=workers),
                   datacache.DataLoader(list(range(10)), batch_size=4)]
        assert sum(len(list(loader)) for loader in loaders) == N // 50 + 3
    ds.close()
    assert [str(w.message) for w in caught] == []
    with warnings.catch_warnings(record=True) as caught:  # the ignore lasted only while it was built
        warnings.simplefilter("always")
        torch.set_vital("Dataloader", "enabled", "True")
    assert [str(w.message) for w in caught] == ["'set_vital' is deprecated, please do not call"]


def _factory(url: str, cache: NodeCache) -> Any:
    def make_ds(dp_rank: int = 0, dp_size: int = 1) -> StreamingDataset:
        return StreamingDataset(url, cache=cache, seed=6, dp_rank=dp_rank, dp_size=dp_size)
    return make_ds


@pytest.mark.parametrize("stages", [[Stage(2, 2, 4, load="loader"), Stage(2, 2)], [Stage(2, 2, 4), Stage(3, 1)],
                                    [Stage(2, 0, 7), Stage(1, 2)]],
                         ids=["same-layout", "more-ranks", "main-then-workers"])
def test_resume_through_it_is_exactly_once(url: str, cache: NodeCache, stages: list[Stage]) -> None:
    """States saved from its workers (several ranks), resumed into the same loader or another layout."""
    check_exactly_once(_factory(url, cache), stages, epoch=1, loader_batch=8, loader=datacache.DataLoader)


def test_resume_at_midpoints(url: str, cache: NodeCache) -> None:
    check_resume(_factory(url, cache), [0, 5, 31, (3, 9)], epoch=2,
                 make_loader=lambda ds: datacache.DataLoader(ds, batch_size=8, num_workers=2))


def test_resume_with_uneven_workers_near_the_end(url: str, cache: NodeCache) -> None:
    """3 persistent workers with unequal batch counts: the state is counted from the batches handed
    out (``datacache.pytorch.rounds``), including after a worker ran out, and the order stays exact."""
    make = _factory(url, cache)
    ds = make()
    n = len(datacache.DataLoader(ds, batch_size=9))
    ds.close()
    assert n % 3, "the workers must hold unequal batch counts"
    check_resume(make, [1, 2, n // 2, n - 2, n - 1, n, (n // 3, n // 3 + 1)], epoch=1,
                 make_loader=lambda ds: datacache.DataLoader(ds, batch_size=9, num_workers=3, persistent_workers=True,
                                                             prefetch_factor=3))


def test_its_state_continues_in_torchdatas_loader_and_back(url: str, cache: NodeCache) -> None:
    """A mid-epoch state of datacache.DataLoader (whose next batch is another worker's than worker
    0's), loaded into the dataset and read on through torchdata's StatefulDataLoader, then that
    loader's state back into datacache.DataLoader: the uninterrupted order."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    make = _factory(url, cache)
    ref_ds = make()
    ref_ds.set_epoch(1)
    ref = [tuple(ids_of(b)) for b in datacache.DataLoader(ref_ds, batch_size=8, num_workers=2)]
    ref_ds.close()
    ds = make()
    ds.set_epoch(1)
    it = iter(datacache.DataLoader(ds, batch_size=8, num_workers=2))
    got = [tuple(ids_of(next(it))) for _ in range(5)]
    state = it.rounds.state(it.handed).to_dict()
    assert state["next_worker"] == 1
    del it
    ds.close()
    ds = StreamingDataset(url, cache=cache, seed=6, batch_size=8)  # what datacache.DataLoader made of make()
    ds.load_state_dict(state)
    stateful = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    sit = iter(stateful)
    got += [tuple(ids_of(next(sit))) for _ in range(4)]
    loader = datacache.DataLoader(make(), batch_size=8, num_workers=2)
    loader.load_state_dict(stateful.state_dict())
    del sit, stateful
    ds.close()
    got += [tuple(ids_of(b)) for b in loader]
    loader.dataset.close()
    assert got == ref


# ---------------------------------------------------------------- the read-ahead (datacache.pytorch.loader._ReadAhead)
@pytest.fixture
def read_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read ahead from the second batch on, whatever the training step's length."""
    from datacache.pytorch import loader as loader_module

    monkeypatch.setattr(loader_module, "_AHEAD_AFTER", 0.0)


def _ahead_threads() -> list[Any]:
    import threading

    return [t for t in threading.enumerate() if t.name == "datacache-loader-ahead"]


@pytest.mark.usefixtures("read_ahead")
def test_batches_read_ahead_are_the_same_batches_and_resume_exactly(url: str, cache: NodeCache) -> None:
    """With the read-ahead: the same batches in the same order as without, every sample once, and
    states saved mid-epoch resume exactly (the batch taken ahead is not counted as handed)."""
    make = _factory(url, cache)
    ref_ds = make()
    ref_ds.set_epoch(1)
    it = iter(datacache.DataLoader(ref_ds, batch_size=8, num_workers=2))
    ref = [tuple(ids_of(b)) for b in it]
    assert it._ahead is not None, "the read-ahead ran"
    ref_ds.close()
    assert sorted(i for b in ref for i in b) == list(range(N))
    check_resume(make, [1, 5, (3, 9)], epoch=1, make_loader=lambda ds: datacache.DataLoader(ds, batch_size=8,
                                                                                             num_workers=2))


@pytest.mark.usefixtures("read_ahead")
def test_a_loop_left_early_then_the_next_epoch_reads_every_sample_once(url: str, cache: NodeCache) -> None:
    """Break out of an epoch while a batch is taken ahead, start the next (persistent workers: torch
    resets its iterator, which the read-ahead must have left), drop an iterator mid-epoch: every
    sample of each full epoch once, and no read-ahead thread outlives its iterator."""
    from tests.helpers.faults import wait_for

    ds = StreamingDataset(url, cache=cache, seed=2)
    loader = datacache.DataLoader(ds, batch_size=16, num_workers=2, persistent_workers=True)
    for epoch in range(3):
        ds.set_epoch(epoch)
        it = iter(loader)
        for _, batch in zip(range(5), it):
            ids_of(batch)
        assert it._ahead is not None and it._ahead._pending, "a batch is being taken ahead"
        ds.set_epoch(epoch + 10)  # a full epoch after the one left early
        ids = [i for b in loader for i in ids_of(b)]
        assert sorted(ids) == list(range(N)), f"epoch {epoch + 10}: not every sample once"
    it = iter(loader)
    next(it), next(it), next(it)
    del it, loader  # mid-epoch, a batch taken ahead
    gc.collect()
    wait_for(lambda: not _ahead_threads(), 30, "the dropped loader's read-ahead thread to end")
    ds.close()


def _failing_collate(samples: list[dict[str, Any]]) -> list[int]:
    ids = [int(s["i"]) for s in samples]
    if 100 in ids:
        raise ValueError("a bad sample: id 100")
    return ids


@pytest.mark.usefixtures("read_ahead")
def test_a_workers_error_reaches_the_loop_through_the_read_ahead(url: str, cache: NodeCache) -> None:
    ds = StreamingDataset(url, cache=cache, shuffle=False)
    loader = datacache.DataLoader(ds, batch_size=10, num_workers=2, collate_fn=_failing_collate)
    got: list[int] = []
    with pytest.raises(ValueError, match="a bad sample: id 100") as err:
        for batch in loader:
            got += batch
    assert "_failing_collate" in str(err.value) or "_failing_collate" in "".join(
        __import__("traceback").format_exception(err.value)), "the worker's traceback is kept"
    assert got == list(range(100)), "the batches before the error, in order"
    del loader
    ds.close()


@pytest.mark.usefixtures("read_ahead")
def test_an_ended_iterator_read_ahead_stays_ended(url: str, cache: NodeCache) -> None:
    ds = StreamingDataset(url, cache=cache, seed=4)
    it = iter(datacache.DataLoader(ds, batch_size=64, num_workers=2))
    assert sorted(i for b in it for i in ids_of(b)) == list(range(N))
    assert it._ahead is not None
    for _ in range(2):  # no thread is left to ask: StopIteration again, never a wait
        with pytest.raises(StopIteration):
            next(it)
    del it
    ds.close()
