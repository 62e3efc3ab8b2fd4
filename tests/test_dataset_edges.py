"""First-day edges of the datasets (issue 37, points 8-13): ``len(ds)`` under ``datacache.DataLoader``,
``ds[i]``, a second ``iter()``, a forgotten ``set_epoch``, ``on_error="skip"`` counted once per
shard, and ``stats()`` that give the dataset's own figures first."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import datacache
from datacache import NodeCache, StreamingDataset, write_dataset

N = 300
pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    u = f"file://{tmp_path_factory.mktemp('edges')}/ds"
    write_dataset(({"i": i, "x": np.full(4, i, np.int32)} for i in range(N)), u, shard_bytes=2000, progress=False)
    return u


def ids(items: Any) -> list[int]:
    """The sample ids of samples or batches, in order."""
    out: list[int] = []
    for item in items:
        i = item["i"]
        out += i.tolist() if isinstance(i, torch.Tensor) and i.dim() else [int(i)]
    return out


# ---------------------------------------------------------------------- point 9: len(ds)
@pytest.mark.parametrize("workers", [0, 2])
def test_len_of_the_dataset_stays_its_sample_count_under_the_loader(url: str, cache: NodeCache, workers: int) -> None:
    ds = StreamingDataset(url, cache=cache, seed=1)
    assert len(ds) == N
    loader = datacache.DataLoader(ds, batch_size=32, num_workers=workers)
    assert len(ds) == N, "the loader's batch size changed what len(ds) counts"
    assert len(loader) == -(-N // 32)
    batches = [ids([b]) for b in loader]
    assert len(batches) == len(loader) and sorted(i for b in batches for i in b) == list(range(N))
    assert len(ds) == N
    ds.close()


# ---------------------------------------------------------------------- point 8: ds[i]
def test_indexing_a_streaming_dataset_names_the_map_style_one(url: str, cache: NodeCache) -> None:
    ds = StreamingDataset(url, cache=cache)
    with pytest.raises(TypeError, match=r"not indexable \(ds\[0\]\).*datacache\.CachedDataset"):
        ds[0]
    ds.close()


def test_cached_dataset_takes_negative_indices_as_a_sequence(url: str, tmp_path: Any) -> None:
    cfg = datacache.CacheConfig(ram_bytes="8MB", ssd_bytes=0, ram_dir=str(tmp_path / "ram"),
                                ssd_dir=str(tmp_path / "s"))
    ds = datacache.CachedDataset(url, cache=cfg)
    assert [int(ds[k]["i"]) for k in (-1, -N, np.int64(-2), torch.tensor(5))] == [N - 1, 0, N - 2, 5]
    for bad in (N, -N - 1):
        with pytest.raises(IndexError, match=rf"index {bad} out of range for .*{N} samples"):
            ds[bad]
    ds.plan(range(N - 10, N))
    assert [int(ds[k]["i"]) for k in range(-10, 0)] == list(range(N - 10, N))  # planned reads, by negative index
    assert sum(1 for _ in ds) == N  # a for loop over it ends at the IndexError
    ds.close()


# ---------------------------------------------------------------------- point 10: a second iter()
@pytest.mark.parametrize("batch_size", [None, 16])
def test_a_second_iter_ends_the_first_in_plain_words(url: str, cache: NodeCache, batch_size: int | None) -> None:
    ds = StreamingDataset(url, cache=cache, batch_size=batch_size)
    first = iter(ds)
    next(first), next(first)
    second = iter(ds)  # a notebook cell run again
    got = ids([next(second)])
    with pytest.raises(RuntimeError, match=r"ended by a new iter\(\) over the same StreamingDataset") as err:
        next(first)
    assert ds.store.url in str(err.value)
    got += ids(second)
    assert sorted(got) == list(range(N)), "the new iteration delivers its epoch whole"
    third, fourth = iter(ds), iter(ds)  # created before it started: the older one still ends
    assert sorted(ids(fourth)) == list(range(N))
    with pytest.raises(RuntimeError, match=r"ended by a new iter\(\)"):
        next(third)
    ds.close()


# ---------------------------------------------------------------------- point 11: a forgotten set_epoch
LOADERS = {
    "main": lambda ds: ds,
    "torch-workers": lambda ds: torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2),
    "torch-persistent": lambda ds: torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2,
                                                               persistent_workers=True),
    "datacache-workers": lambda ds: datacache.DataLoader(ds, batch_size=None, num_workers=2),
    "datacache-persistent": lambda ds: datacache.DataLoader(ds, batch_size=None, num_workers=2,
                                                            persistent_workers=True),
    "torchdata-workers": lambda ds: StatefulDataLoader(ds, batch_size=None, num_workers=2),
}


def epochs_of(url: str, cache: NodeCache, how: str, explicit: bool, n: int = 3) -> list[list[int]]:
    """``n`` epochs of a batched dataset read through ``LOADERS[how]``, with or without set_epoch."""
    ds = StreamingDataset(url, cache=cache, seed=5, batch_size=20)
    loader = LOADERS[how](ds)
    out = []
    for e in range(n):
        if explicit:
            ds.set_epoch(e)
        out.append(ids(loader))
        assert ds.epoch == e
    del loader
    ds.close()
    return out


@pytest.mark.parametrize("how", list(LOADERS))
def test_without_set_epoch_each_iteration_reads_the_next_epoch(url: str, cache: NodeCache, how: str) -> None:
    auto = epochs_of(url, cache, how, explicit=False)
    assert all(sorted(e) == list(range(N)) for e in auto), "each epoch reads every sample once"
    assert auto[0] != auto[1] != auto[2] != auto[0], "three epochs in the same order"
    assert auto == epochs_of(url, cache, how, explicit=True), "the epochs set_epoch(0), (1), (2) would read"


@pytest.mark.parametrize("saved, resumed", [("main", "main"), ("datacache-workers", "datacache-workers"),
                                             ("torchdata-workers", "torchdata-workers"), ("main", "torch-workers"),
                                             ("main", "torch-persistent")])
def test_automatic_epochs_resume_exactly_and_go_on(url: str, cache: NodeCache, saved: str, resumed: str) -> None:
    """Epoch 0 read, 4 batches of epoch 1, a checkpoint; the restarted job (no set_epoch either)
    finishes epoch 1 exactly (the same order in the same layout; exactly once into another
    layout: the state loaded into the dataset, which torch's workers inherit), then reads epoch 2."""
    def loader_of(ds: StreamingDataset, how: str) -> Any:
        return datacache.DataLoader(ds, batch_size=None) if how == "main" else LOADERS[how](ds)

    ref = epochs_of(url, cache, saved, explicit=True)
    ds = StreamingDataset(url, cache=cache, seed=5, batch_size=20)
    loader = loader_of(ds, saved)
    assert ids(loader) == ref[0]
    it = iter(loader)
    head = ids([next(it) for _ in range(4)])
    state = loader.state_dict()
    del it, loader
    ds.close()
    ds = StreamingDataset(url, cache=cache, seed=5, batch_size=20)  # the restarted job
    loader = loader_of(ds, resumed)
    (loader if saved == resumed else ds).load_state_dict(state)
    rest = ids(loader)
    assert ds.epoch == 1
    if saved == resumed:
        assert head + rest == ref[1], "the resumed epoch continues exactly"
    else:
        assert sorted(head + rest) == list(range(N)), "the resumed epoch reads every sample once"
    assert ids(loader) == epochs_of(url, cache, resumed, explicit=True)[2] and ds.epoch == 2, "then epoch 2"
    del loader
    ds.close()


def test_set_epoch_keeps_full_control(url: str, cache: NodeCache) -> None:
    ds = StreamingDataset(url, cache=cache, seed=5)
    first = ids(ds)
    ds.set_epoch(7)
    seven = ids(ds)
    assert seven != first and ids(ds) == seven and ds.epoch == 7, "an explicit epoch stays until set_epoch again"
    ds.close()


def test_the_workers_of_one_iteration_decide_one_epoch_in_any_interleaving() -> None:
    """``datacache.pytorch.shared.AutoEpochs``: worker 1 did not begin the last iteration (epoch 3: the loop broke
    off at once); in the next, whichever worker begins first, both read epoch 4."""
    from datacache.pytorch.shared import AutoEpochs

    for first, second in ((1, 2), (2, 1)):
        epochs = AutoEpochs()
        epochs.begin(11, 1, base=0), epochs.begin(11, 2, base=0)  # epoch 0 (the base), both workers
        for e, token in ((1, 12), (2, 13), (3, 14)):
            assert epochs.begin(token, 1, base=0) == e  # worker 0 (slot 1) alone
        assert [epochs.begin(15, slot, base=0) for slot in (first, second)] == [4, 4]
        assert epochs.begin(16, 0, base=0) == 5  # the main process next
        epochs.clear()  # a state was loaded
        assert epochs.begin(17, 1, base=0, fixed=2, inherited=True) == 2
        assert epochs.begin(17, 2, base=0, fixed=2, inherited=True) == 2
        assert epochs.begin(18, 1, base=0, fixed=2, inherited=True) == 3, "a later iteration: the state was used"


# ---------------------------------------------------------------------- point 12: on_error="skip" once
def _warnings_to_stderr(_: int) -> None:
    """A DataLoader worker's warnings to its stderr, each (forked, it inherits pytest's recording)."""
    import sys
    import warnings

    warnings.simplefilter("always")
    warnings.showwarning = lambda message, category, *_, **__: print(f"{category.__name__}: {message}",
                                                                     file=sys.__stderr__, flush=True)


@pytest.mark.timeout(180)
def test_a_skipped_shard_warns_and_counts_once_per_epoch_for_all_workers(tmp_path: Any, cache: NodeCache,
                                                                         capfd: pytest.CaptureFixture[str]) -> None:
    """A part-mixed cold epoch: both DataLoader workers read parts of every shard, the missing one
    too. One warning and one count per epoch on the node; a new job (a new dataset object) warns
    again for its epoch 0."""
    import os

    n = 1200
    u = f"file://{tmp_path}/ds"
    m = write_dataset(({"i": i, "x": np.full(64, i, dtype=np.int32)} for i in range(n)), u,
                      shard_bytes=8000, progress=False, writer_options={"block_bytes": 2048})
    os.unlink(os.path.join(tmp_path, "ds", m.shards[3].name))
    lo, hi = m.offsets[3], m.offsets[4]
    others = [i for i in range(n) if not lo <= i < hi]

    def epoch(ds: StreamingDataset) -> list[int]:
        return sorted(ids(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2,
                                                      worker_init_fn=_warnings_to_stderr)))

    ds = StreamingDataset(u, cache=cache, seed=1, on_error="skip", batch_size=16)
    capfd.readouterr()
    for e in range(2):
        ds.set_epoch(e)
        assert epoch(ds) == others
        err = capfd.readouterr().err
        assert err.count("skipping shard") == 1, f"epoch {e}: {err.count('skipping shard')} warnings:\n{err}"
        assert ds.stats()["skipped_shards"] == e + 1
    again = StreamingDataset(u, cache=cache, seed=1, on_error="skip", batch_size=16)
    assert epoch(again) == others and capfd.readouterr().err.count("skipping shard") == 1, "a new job warns again"
    assert ds.stats()["skipped_shards"] == 3
    ds.close()
    again.close()


# ---------------------------------------------------------------------- point 13: the dataset's own stats
@pytest.mark.parametrize("workers", [0, 2])
def test_stats_give_the_datasets_own_figures_first(url: str, tmp_path: Any, cache: NodeCache, workers: int) -> None:
    """Two datasets on one node cache: each one's ``stats()["dataset"]`` holds its own reads only
    (its shards and its manifest, whatever its DataLoader workers did); the rest is node-wide."""
    import os

    other = f"file://{tmp_path}/other"
    write_dataset(({"i": i, "x": np.full(4, i, np.int32)} for i in range(100)), other, shard_bytes=2000,
                  progress=False)

    def read(u: str) -> tuple[StreamingDataset, int]:
        ds = StreamingDataset(u, cache=cache, node_shuffle="never", batch_size=10)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        assert len(ids(loader)) == ds.manifest.num_samples
        return ds, ds.manifest.total_bytes + os.path.getsize(u.removeprefix("file://") + "/manifest.json")

    a, a_bytes = read(url)
    b, b_bytes = read(other)
    st = a.stats()
    assert next(iter(st)) == "dataset", "the dataset's own figures come first"
    own = st["dataset"]
    assert own["samples"] == N and own["remote_bytes"] == a_bytes and own["epoch"] == 0
    assert own["skipped_shards"] == 0 and own["requests"] >= len(a.manifest.shards) and own["wait_seconds"] >= 0
    assert st["samples"] == N + 100 and st["remote_bytes"] == a.manifest.total_bytes + b.manifest.total_bytes
    assert b.stats()["dataset"]["samples"] == 100 and b.stats()["dataset"]["remote_bytes"] == b_bytes
    a.close()
    b.close()
