"""Every field type through ``datacache.DataLoader``'s batches (issue 40): arrays, bytes, str,
ragged arrays, numbers and nested dicts; the columnar gather (the default: no transform) equal to
the per-sample collation (a transform) batch for batch; bytes and str as default_collate's lists
or as ``PackedBytes`` views; exactly once and a warm shuffle's quality with the default shuffle;
``pin_memory=True``; a resume mid-epoch; and the columnar reads under it (``readers.columns``)."""
from __future__ import annotations

import gc
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import datacache
from datacache import NodeCache, StreamingDataset, write_dataset
from datacache.pytorch.batches import PackedBytes, RingCollator
from datacache.pytorch.collate import collate
from datacache.readers.columns import Columns
from datacache.readers.zstd import RAW_BLOCK, BlockCache, ZstdShardReader, ZstdShardWriter
from tools.bench_quality import batch_quality

N = 600
pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
              pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")]


def sample(i: int) -> dict[str, Any]:
    """Sample ``i``: a fixed array (incompressible, or zeros in every other run of 32 samples, so
    some blocks are stored raw and some compressed), bytes and str of varying lengths (some
    non-ASCII), a ragged array, a 0-d array and numbers."""
    rng = np.random.default_rng(i)
    image = rng.integers(0, 255, (24, 24, 3), dtype=np.uint8) if i // 32 % 2 else np.zeros((24, 24, 3), np.uint8)
    return {"image": image,
            "blob": rng.bytes(i % 97),
            "text": ("é" if i % 7 == 0 else "x") * (i % 13) + str(i),
            "tokens": np.arange(i % 11, dtype=np.int32) + i,
            "score": np.array(np.float32(i / 4)),
            "label": i % 10, "weight": i / 8, "id": i}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    u = f"file://{tmp_path_factory.mktemp('fields')}/ds"
    m = write_dataset((sample(i) for i in range(N)), u, shard_bytes=200_000, writer_options={"block_bytes": 16_000},
                      progress=False)
    assert len(m.shards) >= 5
    return u


def _same(got: Any, want: Any, where: str = "batch") -> None:
    """``got`` equals ``want`` in type, structure, dtype, shape and value."""
    assert type(got) is type(want), f"{where}: {type(got).__name__}, expected {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{where}: {got.dtype}{list(got.shape)}"
        assert torch.equal(got, want), f"{where}: values differ"
    elif isinstance(want, np.ndarray):
        assert (got.dtype, got.shape) == (want.dtype, want.shape) and np.array_equal(got, want), where
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


def expected(ids: list[int]) -> dict[str, Any]:
    """What default_collate gives for these samples, ragged arrays left a list (as datacache does),
    which torch's DataLoader turns into tensors (``default_convert``, as for any batch it is given)."""
    samples = [sample(i) for i in ids]
    out = default_collate([{k: v for k, v in s.items() if k != "tokens"} for s in samples])
    out["tokens"] = [torch.from_numpy(s["tokens"]) for s in samples]
    return {k: out[k] for k in samples[0]}


def identity(s: dict[str, Any]) -> dict[str, Any]:
    return s


def _epochs(url: str, cache: NodeCache, epochs: int, **kw: Any) -> list[list[Any]]:
    workers = kw.pop("num_workers", 2)
    pin = kw.pop("pin_memory", False)
    ds = StreamingDataset(url, cache=cache, seed=3, **kw)
    loader = datacache.DataLoader(ds, batch_size=16, num_workers=workers, persistent_workers=workers > 0,
                                  pin_memory=pin)
    out = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        out.append(list(loader))
    del loader
    ds.close()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("node_shuffle", ["auto", "never"])
def test_every_field_type_is_default_collated_exactly_once(url: str, cache: NodeCache, node_shuffle: str) -> None:
    """Two workers, epochs 0 (cold) and 1 (warm, with the default a uniform node mix): each batch
    is default_collate's of its samples, and every sample comes once per epoch."""
    for epoch, batches in enumerate(_epochs(url, cache, 2, node_shuffle=node_shuffle)):
        ids: list[int] = []
        for b in batches:
            got = b["id"].tolist()
            _same(b, expected(got), f"epoch {epoch}")
            ids += got
        assert sorted(ids) == list(range(N)), f"epoch {epoch}: not exactly once"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [0, 2])
def test_gathered_batches_equal_the_per_sample_paths(url: str, cache: NodeCache, workers: int) -> None:
    """The same plan read through the columnar gather (no transform) and sample by sample (an
    identity transform): the same batches, in the same order, cold and warm."""
    fast = _epochs(url, cache, 2, num_workers=workers)
    slow = _epochs(url, cache, 2, num_workers=workers, transform=identity)
    for epoch, (a, b) in enumerate(zip(fast, slow)):
        assert len(a) == len(b)
        for k, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"epoch {epoch} batch {k}")


@pytest.mark.timeout(120)
def test_the_warm_epoch_is_gathered_and_reads_each_block_once(url: str, cache: NodeCache) -> None:
    ds = StreamingDataset(url, cache=cache, seed=3, batch_size=16)
    for epoch in range(2):
        ds.set_epoch(epoch)
        ids = [i for b in ds for i in b["id"].tolist()]
        assert sorted(ids) == list(range(N))
        c = ds._consumer
        assert c is not None and c.columnar == (epoch == 1), "the warm epoch is a node mix, read as tables"
    assert c._blocks is not None
    compressed = 0
    for shard in range(len(ds.manifest.shards)):
        with ds.source.fetch(shard) as handle:
            compressed += int(((ZstdShardReader(handle.path)._blocks[:, 0] >> np.uint64(63)) == 0).sum())
    assert compressed and c._blocks.misses == compressed, "a compressed block decompressed twice in the epoch"
    ds.close()


@pytest.mark.timeout(240)
def test_warm_shuffle_quality_is_a_random_permutations(tmp_path: Any, cache: NodeCache) -> None:
    """Class-sorted data (class = id * 100 // n), batches of 64: the warm epoch's distinct classes
    per batch are at least 0.95 of a uniform random permutation's."""
    n = 6400
    u = f"file://{tmp_path}/sorted"
    write_dataset(({"x": np.full(16, i % 251, np.uint8), "id": i} for i in range(n)), u, shard_bytes=20_000,
                  progress=False)
    ds = StreamingDataset(u, cache=cache, seed=5)
    loader = datacache.DataLoader(ds, batch_size=64, num_workers=2, persistent_workers=True)
    for epoch in range(2):
        ds.set_epoch(epoch)
        batches = [b["id"].numpy().copy() for b in loader]
        assert sorted(np.concatenate(batches).tolist()) == list(range(n))
    assert batch_quality(batches, n) >= 0.95
    del loader
    ds.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [0, 2])
def test_bytes_views_are_packed_zero_copy_views(url: str, cache: NodeCache, workers: int) -> None:
    for batches in _epochs(url, cache, 2, num_workers=workers, bytes_views=True):
        for b in batches:
            want = expected(b["id"].tolist())
            for field in ("blob", "text"):
                p = b[field]
                assert isinstance(p, PackedBytes) and p.kind == ("str" if field == "text" else "bytes")
                assert p.tolist() == want[field] and len(p) == len(want[field])
                assert [p[i] if field == "text" else bytes(p[i]) for i in range(len(p))] == want[field]
                if field == "blob":
                    assert all(torch.equal(p.tensor(i), torch.frombuffer(bytearray(v), dtype=torch.uint8))
                               for i, v in enumerate(want[field]) if v)
            _same({k: v for k, v in b.items() if k not in ("blob", "text")},
                  {k: v for k, v in want.items() if k not in ("blob", "text")})


def test_packed_bytes_keep_their_slot_and_pickle() -> None:
    ring = RingCollator(shared=False, slots=1, bytes_views=True)
    samples = [{"b": bytes([k]) * k, "s": "é" * k} for k in range(5)]
    batch = ring(samples)
    views = batch["b"]
    assert ring.ring is not None and ring.ring.in_use() == 1
    del batch
    gc.collect()
    assert ring.ring.in_use() == 1, "a PackedBytes view keeps its slot"
    again = ring(samples)
    assert ring.ring.fallbacks == 1 and again["s"].tolist() == [s["s"] for s in samples]
    assert pickle.loads(pickle.dumps(views)).tolist() == [s["b"] for s in samples]
    del views, again
    gc.collect()
    assert ring.ring.in_use() == 0


def test_generic_collation_carries_bytes_str_and_ragged_values_through_the_ring() -> None:
    """With a transform (nested dicts, tensors): bytes and str lists, ragged arrays and tensors
    come from the ring slot as default_collate's (or datacache's list) types."""
    ring = RingCollator(shared=False)
    samples = [{"a": {"b": bytes([k]) * k, "s": "ü" * k + "a"}, "t": torch.arange(k), "r": np.ones((k, 2)),
                "n": [k, {"deep": np.int16(k)}]} for k in range(1, 6)]
    batch = ring(samples)
    assert batch["a"]["b"] == [s["a"]["b"] for s in samples] and batch["a"]["s"] == [s["a"]["s"] for s in samples]
    assert isinstance(batch["t"], list) and all(torch.equal(x, s["t"]) for x, s in zip(batch["t"], samples))
    assert all(type(x) is np.ndarray and np.array_equal(x, s["r"]) for x, s in zip(batch["r"], samples))
    _same(batch["n"], default_collate([s["n"] for s in samples]))
    assert ring.ring is not None and ring.ring.in_use() == 1
    del batch
    gc.collect()
    assert ring.ring.in_use() == 0
    assert collate(samples)["a"]["s"] == [s["a"]["s"] for s in samples]


def test_shared_ring_batch_of_every_kind_unpickles_in_another_process_layout() -> None:
    """A worker's ring batch (bytes, str, ragged) through pickle, as torch's queue sends it."""
    ring = RingCollator(shared=True)
    samples = [{"b": bytes([k]) * k, "s": "é" * k, "r": np.arange(k, dtype=np.int64), "x": np.full(3, k)}
               for k in range(4)]
    got = pickle.loads(pickle.dumps(ring(samples)))
    assert got["b"] == [s["b"] for s in samples] and got["s"] == [s["s"] for s in samples]
    assert all(np.array_equal(a, s["r"]) for a, s in zip(got["r"], samples))
    assert torch.equal(got["x"], torch.tensor(np.stack([s["x"] for s in samples])))
    ring.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [0, 2])
def test_pin_memory_gives_the_same_batches_pinned_where_torch_can(url: str, cache: NodeCache, workers: int) -> None:
    pinned = _epochs(url, cache, 2, num_workers=workers, pin_memory=True)
    plain = _epochs(url, cache, 2, num_workers=workers)
    can_pin = torch.cuda.is_available()
    for a, b in zip(pinned, plain):
        for x, y in zip(a, b):
            _same(x, y)
            assert x["image"].is_pinned() == can_pin


def test_a_ring_is_registered_as_pinned_memory_only_where_cuda_is() -> None:
    ring = RingCollator(shared=False, pin=True)
    batch = ring([{"x": np.full(4, k)} for k in range(8)])
    assert ring.ring is not None and bool(ring.ring._state.pinned) == torch.cuda.is_available()
    assert batch["x"].is_pinned() == torch.cuda.is_available()
    assert torch.equal(batch["x"][:, 0], torch.arange(8))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("epoch", [0, 1])
def test_resume_mid_epoch_continues_the_same_batches(url: str, cache: NodeCache, epoch: int) -> None:
    """Two workers: stop after 7 batches of epoch ``epoch`` (1: the warm node mix), resume from
    the loader's state in a new loader: the rest of the epoch's batches, as they would have come."""
    def loader_for(ds: StreamingDataset) -> Any:
        return datacache.DataLoader(ds, batch_size=16, num_workers=2)

    ds = StreamingDataset(url, cache=cache, seed=9)
    loader = loader_for(ds)
    for e in range(epoch + 1):
        ds.set_epoch(e)
        whole = [b["id"].tolist() for b in loader]
    ds.set_epoch(epoch)
    it = iter(loader)
    head = [next(it)["id"].tolist() for _ in range(7)]
    state = loader.state_dict()
    del it, loader
    ds.close()
    assert head == whole[:7]
    ds2 = StreamingDataset(url, cache=cache, seed=9)
    loader2 = loader_for(ds2)
    loader2.load_state_dict(state)
    rest = [b for b in loader2]
    assert [b["id"].tolist() for b in rest] == whole[7:]
    for b in rest:
        _same(b, expected(b["id"].tolist()))
    del loader2
    ds2.close()


# ---------------------------------------------------------------- columnar reads
def _shard(tmp_path: Any, samples: list[dict[str, Any]], schema: dict[str, str], block_bytes: int) -> str:
    path = str(tmp_path / "s.dcz")
    w = ZstdShardWriter(path, schema, block_bytes=block_bytes)
    for s in samples:
        w.write(s)
    w.close()
    return path


SCHEMA = {"image": "ndarray", "blob": "bytes", "text": "str", "tokens": "ndarray", "score": "ndarray",
          "label": "int", "weight": "float", "id": "int"}


@pytest.mark.parametrize("block_bytes", [4_000, 40_000])
def test_columns_equal_the_samples(tmp_path: Any, block_bytes: int) -> None:
    r = ZstdShardReader(_shard(tmp_path, [sample(i) for i in range(200)], SCHEMA, block_bytes))
    blocks = BlockCache(1 << 30)
    for lo, hi, rows in ((0, 200, None), (17, 150, None), (3, 190, np.array([3, 3, 4, 77, 120, 189]))):
        table = r.columns(lo, hi, rows, blocks)
        assert isinstance(table, Columns)
        want = range(lo, hi) if rows is None else rows.tolist()
        assert table.n == len(want)
        for k, i in enumerate(want):
            _same(table.sample(k), r.get(i), f"row {i}")


def test_rows_of_one_length_are_read_by_their_own_structure(tmp_path: Any) -> None:
    """Rows of one encoded length are parsed from the first row's structure only where every row's
    structure bytes (sizes, array headers) are the first's; rows of the same length whose arrays
    have other shapes, or whose bytes and str values split the row otherwise, keep their own."""
    rng = np.random.default_rng(0)
    alike = [{"a": rng.integers(0, 255, (2, 3), dtype=np.uint8), "b": rng.bytes(4), "t": "abcd", "i": i}
             for i in range(50)]
    other = [{"a": rng.integers(0, 255, (2, 3) if i % 3 else (3, 2), dtype=np.uint8),
              "b": rng.bytes(4 if i % 2 else 3), "t": "abc" if i % 2 else "abcd", "i": i} for i in range(50)]
    for samples in (alike, other):
        r = ZstdShardReader(_shard(tmp_path, samples, {"a": "ndarray", "b": "bytes", "t": "str", "i": "int"}, 1 << 20))
        table = r.columns(0, 50)
        assert isinstance(table, Columns)
        for k in range(50):
            _same(table.sample(k), samples[k], f"row {k}")
        r.close()


def test_rows_too_irregular_for_one_table_are_left_to_the_samples(tmp_path: Any) -> None:
    samples = [{"a": np.zeros(3, np.float32 if i % 2 else np.int16)} for i in range(10)]
    r = ZstdShardReader(_shard(tmp_path, samples, {"a": "ndarray"}, 1 << 20))
    assert r.columns(0, 10) is None
    assert r.columns(0, 1) is not None


def test_a_raw_block_a_live_view_wrote_is_read_as_in_the_file(tmp_path: Any) -> None:
    samples = [{"x": np.random.default_rng(i).integers(0, 255, 4096, dtype=np.uint8)} for i in range(8)]
    r = ZstdShardReader(_shard(tmp_path, samples, {"x": "ndarray"}, 1 << 20))
    view = r.get(2)["x"]
    view[:] = 0  # the sample is writable; the file is not changed
    table = r.columns(0, 8)
    assert table is not None
    assert all(np.array_equal(table.sample(k)["x"], samples[k]["x"]) for k in range(8))
    assert not view.any()


def test_a_raw_shard_s_runs_are_rows_of_its_whole_table(tmp_path: Any) -> None:
    """Where every block is raw, the reader makes every row's table once and a run takes its rows
    from it; a region handed out and written meanwhile still reads as in the file."""
    rng = np.random.default_rng(7)
    samples = [{"x": rng.integers(0, 255, (64, 8), dtype=np.uint8), "b": rng.bytes(int(rng.integers(0, 300))),
                "i": i} for i in range(40)]
    r = ZstdShardReader(_shard(tmp_path, samples, {"x": "ndarray", "b": "bytes", "i": "int"}, 1 << 12))
    assert ((r._blocks[:, 0] & np.uint64(RAW_BLOCK)) != 0).all(), "the fixture's blocks should be raw"
    for call, (lo, hi, rows) in enumerate(((5, 30, None), (0, 40, np.array([0, 9, 9, 21, 39])), (0, 40, None))):
        table = r.columns(lo, hi, rows)
        assert isinstance(table, Columns) and isinstance(r._whole, Columns) == (call > 0), "made at the second call"
        want = range(lo, hi) if rows is None else rows.tolist()
        for k, i in enumerate(want):
            _same(table.sample(k), samples[i], f"row {i}")
    view = r.get(3)["x"]
    view[:] = 0
    table = r.columns(0, 40)
    assert table is not None
    for k in range(40):
        _same(table.sample(k), samples[k], f"row {k} after a view of row 3 was written")
    del view
    r.close()
    assert r._whole is None


@pytest.mark.parametrize("values, bad", [
    (["é", "ü€", "", "ok", "日本"], None),
    ([b"\xc3", b"\xa9"], 0),  # each half of one character: the whole decodes, no value does
    ([b"ab", b"\xff", b"c"], 1),
    ([b"\xe6\x97", b"\xa5"], 0),
])
def test_a_gathered_str_column_is_checked_value_by_value(values: list[Any], bad: int | None) -> None:
    """The columnar gather checks a batch's str column (non-ASCII) as the readers would, one value
    at a time: a value that is not UTF-8 is a ReaderError, even where the values' bytes together are."""
    from datacache.pytorch.gather import _check_utf8
    from datacache.readers import ReaderError

    raw = [v.encode() if isinstance(v, str) else v for v in values]
    data = np.frombuffer(b"".join(raw), np.uint8)
    offsets = np.cumsum([0] + [len(r) for r in raw]).astype(np.int64)
    if bad is None:
        _check_utf8(data, offsets, "s")
        return
    with pytest.raises(ReaderError, match="field 's': str field is not valid UTF-8"):
        _check_utf8(data, offsets, "s")
