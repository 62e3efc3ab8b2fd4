"""Batched mode: collation equal to torch's default_collate (through the ring fast path), ``len()``
equal to what a DataLoader delivers for any num_workers and drop_last, whole batches per worker in
the plan, and a DataLoader that batches again refused in one line."""
from __future__ import annotations

import gc
import math
import pickle
import threading
import warnings
from collections import Counter, namedtuple
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.optim.lr_scheduler import OneCycleLR
from torch.utils.data import DataLoader, default_collate

from datacache import NodeCache, StreamingDataset, write_dataset
from datacache.plan.epoch import PlanSpec, build_plan
from datacache.pytorch.batches import RingCollator, ShmTensor, collate
from tests.helpers import faults as H

N = 2000
# test_len_is_what_comes in samples mode: one sample per item through the workers, 2 epochs (and an
# optimizer and scheduler step each): 7 shards (the last short) split over 2 and 4 workers as unevenly
# as the 27 of N (7 and 27 are 3 mod 4, 1 mod 2)
N_SAMPLES = 500
pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]
Pair = namedtuple("Pair", "a b")


# ---------------------------------------------------------------- collation
def _same(got: Any, want: Any, where: str = "batch") -> None:
    """``got`` has default_collate's types, structure, dtypes, shapes and values."""
    assert type(got) is type(want), f"{where}: {type(got).__name__}, default_collate gives {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{where}: {got.dtype}{list(got.shape)}"
        assert torch.equal(got, want), f"{where}: values differ"
    elif isinstance(want, Mapping):
        assert list(got) == list(want), f"{where}: keys"
        for k in want:
            _same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length"
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def _rng(i: int) -> np.random.Generator:
    return np.random.default_rng(i)


CASES: dict[str, Any] = {
    "tensor_and_int": lambda i: {"image": torch.from_numpy(_rng(i).random((3, 4, 4), np.float32)), "label": i},
    "np_int64_label": lambda i: {"image": _rng(i).integers(0, 255, (4, 4), np.uint8), "label": np.int64(i)},
    "tuple": lambda i: (torch.full((3, 4, 4), float(i)), i % 10),
    "nested": lambda i: {"a": {"b": np.float32(i / 2), "c": [torch.tensor([i, -i]), i / 3]}, "s": str(i),
                         "raw": bytes([i % 256]), "flag": i % 2 == 0},
    "namedtuple": lambda i: Pair(np.float16(i), [torch.tensor(i), np.array(i, np.int16)]),
    "numpy_scalars": lambda i: {d: np.dtype(d).type(i % 2) for d in
                                ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32",
                                 "float16", "float32", "float64", "complex64")},
    "arrays": lambda i: {d: np.full((2, 3), i % 2, d) for d in
                         ("bool", "uint8", "uint16", "uint32", "uint64", "float16", "int64", "complex128")},
    "strided": lambda i: {"t": torch.arange(12.0).reshape(3, 4).t() + i, "a": np.arange(12).reshape(3, 4).T * i,
                          "empty": np.zeros((0, 3), np.float32)},
    "tensor_only": lambda i: torch.tensor([i, i + 1], dtype=torch.int32),
    "int_only": lambda i: i,
    "not_fixed": lambda i: {"bf16": torch.full((2,), float(i), dtype=torch.bfloat16), "mixed": [1, 2.5][i % 2],
                            "grad": torch.ones(2, requires_grad=True) * i},
}


@pytest.mark.parametrize("case", list(CASES))
def test_collate_equals_default_collate(case: str) -> None:
    samples = [CASES[case](i) for i in range(5)]
    want = default_collate(samples)
    _same(collate(samples), want)
    ring = RingCollator(shared=False)
    got = ring(samples)
    _same(got, want)
    if case != "not_fixed":  # every tensor, array and number column went into the ring
        assert ring.ring is not None and ring.ring.published == 1 and ring.ring.in_use() == 1
        del got
        gc.collect()
        assert ring.ring.in_use() == 0


def test_shared_ring_batch_unpickles_into_default_collates_structure() -> None:
    samples = [CASES["nested"](i) for i in range(6)]
    ring = RingCollator(shared=True, slots=2)
    sent = ring(samples)
    assert isinstance(sent["a"]["b"], ShmTensor) and isinstance(sent["a"]["c"][0], ShmTensor)
    got = pickle.loads(pickle.dumps(sent))  # as a DataLoader worker's batch reaches the main process
    _same(got, default_collate(samples))
    assert got["a"]["b"].untyped_storage().data_ptr() != 0
    del got, sent
    gc.collect()


def test_what_default_collate_refuses_stays_a_list() -> None:
    samples = [{"ragged": np.arange(i + 1), "rt": torch.ones(i + 1), "names": np.array(["a"] * 2), "none": None,
                "x": i} for i in range(3)]
    out = collate(samples)
    assert [len(v) for v in out["ragged"]] == [1, 2, 3] and [len(v) for v in out["rt"]] == [1, 2, 3]
    assert isinstance(out["names"], list) and out["none"] == [None] * 3 and out["x"].tolist() == [0, 1, 2]


def test_shared_ring_batch_refuses_default_collate() -> None:
    ring = RingCollator(shared=True, slots=2)
    batch = ring([{"x": np.ones(3)} for _ in range(4)])
    with pytest.raises(ValueError, match="pass batch_size=None to the DataLoader"):
        default_collate([batch])
    pickle.loads(pickle.dumps(batch))  # received: the ring file is unlinked


# ---------------------------------------------------------------- through a DataLoader
def _write(tmp_path_factory: pytest.TempPathFactory, n: int) -> tuple[str, list[int]]:
    """An ``n``-sample dataset of ~76-sample shards: its URL and its shards' sample counts."""
    u = f"file://{tmp_path_factory.mktemp('batching')}/ds"
    m = write_dataset(({"i": i, "x": np.full(4, i, np.int32)} for i in range(n)), u, shard_bytes=4000, progress=False)
    return u, [s.samples for s in m.shards]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2000-sample dataset in ~20 shards."""
    u, shards = _write(tmp_path_factory, N)
    assert 10 <= len(shards) <= 40
    return u


@pytest.fixture(scope="module")
def samples_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An N_SAMPLES-sample dataset whose shards split over 2 and 4 workers unevenly, the last one short."""
    u, shards = _write(tmp_path_factory, N_SAMPLES)
    assert len(shards) % 2 and len(shards) % 4 > 1 and shards[-1] < shards[0]
    return u


def image_and_label(s: dict[str, Any]) -> dict[str, Any]:
    return {"image": torch.full((3, 4, 4), float(s["i"])), "label": np.int64(s["i"])}


def as_tuple(s: dict[str, Any]) -> tuple[torch.Tensor, int]:
    return torch.from_numpy(s["x"].copy()), int(s["i"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_batches_are_default_collated(url: str, cache: NodeCache, workers: int) -> None:
    ds = StreamingDataset(url, cache=cache, batch_size=8, transform=image_and_label, seed=1)
    ids: list[int] = []
    for b in DataLoader(ds, batch_size=None, num_workers=workers):
        assert isinstance(b["image"], torch.Tensor) and b["image"].shape == (8, 3, 4, 4)
        assert b["label"].dtype == torch.int64 and torch.equal(b["image"][:, 0, 0, 0], b["label"].float())
        ids += b["label"].tolist()
    assert sorted(ids) == list(range(N))
    ds.close()
    ds = StreamingDataset(url, cache=cache, batch_size=8, transform=as_tuple, seed=1)
    for x, i in DataLoader(ds, batch_size=None, num_workers=workers):
        assert x.shape == (8, 4) and x.dtype == torch.int32 and i.dtype == torch.int64
        assert torch.equal(x[:, 0].long(), i)
    ds.close()


def _run_epochs(ds: StreamingDataset, loader: DataLoader, epochs: int) -> list[list[list[int]]]:
    """Every epoch's batches as id lists, stepping a OneCycleLR sized by len(loader)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched = OneCycleLR(opt, max_lr=1.0, total_steps=len(loader) * epochs)
    out = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        with warnings.catch_warnings():  # torch warns when more batches come than len() said
            warnings.filterwarnings("error", message="Length of IterableDataset")
            batches = []
            for b in loader:
                batches.append(torch.as_tensor(b["i"]).reshape(-1).tolist())
                opt.step()
                sched.step()
        assert len(batches) == len(loader), f"epoch {epoch}: {len(batches)} batches, len() said {len(loader)}"
        out.append(batches)
    return out


def _check_batches(batches: list[list[int]], drop_last: bool, size: int = 32, n: int = N) -> None:
    ids = [i for b in batches for i in b]
    if drop_last:
        assert all(len(b) == size for b in batches), "drop_last=True delivered a short batch"
        assert len(set(ids)) == len(ids) == n // size * size
    else:
        assert sorted(ids) == list(range(n))
        assert sorted(len(b) for b in batches)[1:] == [size] * (len(batches) - 1), "more than one short batch"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("workers", [0, 2, 4])
@pytest.mark.parametrize("mode", ["batched", "samples"])
def test_len_is_what_comes(url: str, samples_url: str, cache: NodeCache, mode: str, workers: int,
                           drop_last: bool) -> None:
    """len(DataLoader(ds, batch_size=None)) items come: in batched mode batches, full ones with
    drop_last, and OneCycleLR sized by it works; in samples mode samples (of the smaller dataset)."""
    size, n = (32, N) if mode == "batched" else (1, N_SAMPLES)
    ds = StreamingDataset(url if mode == "batched" else samples_url, cache=cache, batch_size=size if size > 1 else None,
                          drop_last=drop_last, seed=2)
    loader = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
    assert len(loader) == (n // size if drop_last else -(-n // size))
    for batches in _run_epochs(ds, loader, 2):
        _check_batches(batches, drop_last, size, n)
    del loader
    ds.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_yield_equal_exact_batch_counts(url: str, cache: NodeCache, drop_last: bool) -> None:
    seen: Counter[int] = Counter()
    for rank in range(3):
        ds = StreamingDataset(url, cache=cache, batch_size=32, drop_last=drop_last, dp_rank=rank, dp_size=3)
        batches = [b["i"].tolist() for b in DataLoader(ds, batch_size=None, num_workers=2 + rank)]
        assert len(batches) == len(ds) == (N // 3 // 32 if drop_last else math.ceil(math.ceil(N / 3) / 32))
        assert not drop_last or all(len(b) == 32 for b in batches)
        seen.update(i for b in batches for i in b)
        ds.close()
    if drop_last:
        assert max(seen.values()) == 1 and len(seen) == 3 * (N // 3 // 32) * 32
    else:
        assert set(seen) == set(range(N)) and sum(seen.values()) == 3 * -(-N // 3)  # 1 padding repeat


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loader_batch", [None, 32])  # None: the DataLoader's default, 1
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["DataLoader", "StatefulDataLoader"])
def test_batch_size_on_dataset_and_dataloader_is_refused(url: str, cache: NodeCache, kind: str, workers: int,
                                                         loader_batch: int | None) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = StreamingDataset(url, cache=cache, batch_size=32)
    kw = {} if loader_batch is None else {"batch_size": loader_batch}
    loader = (DataLoader if kind == "DataLoader" else StatefulDataLoader)(ds, num_workers=workers, **kw)
    with pytest.raises(ValueError, match=rf"batch_size={loader_batch or 1}\b.*pass batch_size=None to the DataLoader"):
        next(iter(loader))
    del loader
    assert len(list(DataLoader(ds, batch_size=None, num_workers=workers))) == len(ds)  # the fix works
    ds.close()


# ---------------------------------------------------------------- the plan
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(lambda c: sum(c) >= 1),
       st.integers(1, 4), st.integers(1, 5), st.integers(1, 9), st.booleans())
def test_workers_get_whole_batches(counts: list[int], dp_size: int, workers: int, size: int, drop_last: bool) -> None:
    """A rank's batch count is the same for every num_workers; only its last batch is short (none
    with drop_last); every sample once, plus padding."""
    spec = PlanSpec(seed=3, dp_size=dp_size, num_workers=workers, drop_last=drop_last, batch_size=size)
    seen: Counter[int] = Counter()
    for r in range(dp_size):
        one = len(build_plan(np.array(counts), replace(spec, dp_rank=r, num_workers=1)))
        plans = [build_plan(np.array(counts), replace(spec, dp_rank=r, worker_id=w)) for w in range(workers)]
        lengths = [len(p) for p in plans]
        assert sum(-(-n // size) for n in lengths) == -(-one // size) and sum(lengths) == one
        nonempty = [n for n in lengths if n]
        assert all(n % size == 0 for n in nonempty[:-1]), lengths
        if drop_last:
            assert one % size == 0
        for p in plans:
            seen.update(p.samples.tolist())
    total = sum(counts)
    if drop_last:
        assert max(seen.values(), default=1) == 1
        assert len(seen) == total // dp_size // size * size * dp_size
    else:
        assert set(seen) == set(range(total)) and sum(seen.values()) == -(-total // dp_size) * dp_size


@pytest.mark.timeout(120)
def test_resume_with_another_batch_size_is_exactly_once(url: str, cache: NodeCache) -> None:
    """Workers get whole batches, so the plan depends on batch_size: a state saved with another
    one is another layout (its remainder is planned afresh), not skipped into the new plan."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = StreamingDataset(url, cache=cache, batch_size=8, seed=4)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    it = iter(loader)
    first = [i for _ in range(21) for i in next(it)["i"].tolist()]
    state = loader.state_dict()
    del it, loader
    ds.close()
    resumed = StreamingDataset(url, cache=cache, batch_size=32, seed=4)
    resumed.load_state_dict(state)
    rest = [i for b in DataLoader(resumed, batch_size=None, num_workers=2) for i in b["i"].tolist()]
    assert sorted(first + rest) == list(range(N)), "a sample delivered twice or never"
    resumed.close()


def _batcher_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.name.endswith("-batch-0")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("columnar", [True, False], ids=["gathered", "collated"])
def test_an_abandoned_loop_s_batcher_stops_with_the_dataset(url: str, cache: NodeCache, columnar: bool) -> None:
    """A batched loop left without being closed (its generator still referenced, as torch's
    single-process iterator does from a reference cycle until the garbage collector runs): the
    batching thread stops when the dataset starts its next iteration, and when it is closed."""
    kw = {} if columnar else {"transform": image_and_label}
    ds = StreamingDataset(url, cache=cache, batch_size=16, seed=3, **kw)
    before = set(threading.enumerate())
    held = iter(ds)
    next(held)
    first = H.wait_for(lambda: _batcher_threads(before), 30, "the batching thread")
    again = iter(ds)  # the next iteration: the held loop is over
    assert len(next(again)["label" if "transform" in kw else "i"]) == 16
    for t in first:
        t.join(30)
        assert not t.is_alive(), "the abandoned loop's batching thread outlives the next iteration"
    with pytest.raises(RuntimeError, match="ended by a new iter"):
        next(held)
    second = [t for t in _batcher_threads(before) if t not in first]
    assert second
    ds.close()
    for t in second:
        t.join(30)
        assert not t.is_alive(), "a batching thread outlives close()"
    del held, again
