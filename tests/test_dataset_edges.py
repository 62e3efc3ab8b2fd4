"""First-day edges of the datasets (issue 37, points 8-13): ``len(ds)`` under ``datacache.DataLoader``,
``ds[i]``, a second ``iter()``, a forgotten ``set_epoch``, ``on_error="skip"`` counted once per
shard, and ``stats()`` that give the dataset's own figures first."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

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
    cfg = datacache.CacheConfig(ram_bytes="8MB", ssd_bytes=0, ram_dir=str(tmp_path / "ram"), ssd_dir=str(tmp_path / "s"))
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
