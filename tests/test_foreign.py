"""Issue 41: MosaicML Streaming (MDS), LitData and Hugging Face save_to_disk datasets, read in place.

Each dataset is written by the library itself (tests/helpers/foreign.py), indexed by ``datacache
index URL`` with no ``--format`` and read through ``StreamingDataset``; every sample must equal the
library's own reading of the same files: all fields, all rows, several shards, compressed and not,
local and on the S3 server.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import datacache
from datacache import CacheConfig, NodeCache, StreamingDataset, load_manifest, open_store
from datacache.cli.main import EXIT_DATA, EXIT_USAGE, main
from tests.helpers.foreign import (
    hf_reading,
    litdata_reading,
    same,
    streaming_reading,
    upload,
    write_hf,
    write_litdata,
    write_mds,
)


def _index(url: str, capsys: pytest.CaptureFixture[str], rc: int = 0) -> Any:
    code = main(["index", url, "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert code == rc, (code, out, err)
    return json.loads(out) if rc == 0 else err


def _read(url: str, cache: NodeCache, opts: dict[str, Any] | None = None, **kw: Any) -> tuple[list[Any], dict]:
    ds = StreamingDataset(url, storage_options=opts, cache=cache, **{"shuffle": False, **kw})
    try:
        return list(ds), ds.stats()["dataset"]
    finally:
        ds.close()


@pytest.fixture
def s3_env(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The CLI's environment for the session's S3 server; the storage options for the dataset."""
    for k, v in {"AWS_ENDPOINT_URL": s3_server.endpoint_url, "AWS_ACCESS_KEY_ID": s3_server.access_key,
                 "AWS_SECRET_ACCESS_KEY": s3_server.secret_key, "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    return s3_server.storage_options()


# ------------------------------------------------------------------------------------------- MDS
@pytest.mark.parametrize("compression", [None, "zstd:7", "gz", "bz2", "snappy", "br"])
def test_mds_samples_equal_streamings_reading(tmp_path: Path, cache: NodeCache, compression: str | None,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(tmp_path / "mds")
    write_mds(folder, compression=compression)
    before = {n: os.path.getmtime(os.path.join(folder, n)) for n in os.listdir(folder)}
    out = _index(folder, capsys)
    assert out["format"] == "mds" and out["num_samples"] == 30 and out["num_shards"] >= 3
    assert {n: os.path.getmtime(os.path.join(folder, n)) for n in before} == before, "a shard was touched"
    theirs = streaming_reading(folder)
    ours, _ = _read(folder, cache, reader_options={"allow_pickle": True})
    assert len(ours) == len(theirs) == 30
    for i, (a, b) in enumerate(zip(ours, theirs)):
        same(a, b, f"sample {i}")
        assert all(isinstance(a[c], bytes) for c in ("jpg", "png", "pil")), "images are encoded bytes by default"
    decoded, _ = _read(folder, cache, reader_options={"allow_pickle": True, "decode_images": True})
    for i, (a, b) in enumerate(zip(decoded, theirs)):
        same(a, b, f"decoded sample {i}")
        assert type(a["jpg"]) is type(b["jpg"]) and type(a["jl"][0]) is type(b["jl"][0])


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_mds_on_s3_reads_as_streaming_and_fetches_each_byte_once(tmp_path: Path, cache: NodeCache, s3_env: Any,
                                                                 make_s3_url: Any, compression: str | None,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    folder, url = str(tmp_path / "mds"), make_s3_url()
    write_mds(folder, compression=compression, columns={"id": "int", "a": "ndarray", "s": "str", "j": "json",
                                                        "jpg": "jpeg"})
    upload(folder, url, s3_env)
    _index(url, capsys)
    m = load_manifest(open_store(url, s3_env))
    ours, stats = _read(url, cache, s3_env, shuffle=True, seed=3)  # a cold shuffled epoch: plain shards part by part
    theirs = streaming_reading(folder)
    ids = [s["id"] for s in ours]
    assert sorted(ids) == [s["id"] for s in theirs] and ids != sorted(ids), "every sample once, shuffled"
    for a in ours:
        same(a, theirs[a["id"]], f"sample {a['id']}")
    partial = cache.stats()["partial_bytes"]  # plain shards are read part by part, compressed ones whole
    assert (partial > 0) if compression is None else (partial == 0), partial
    manifest_bytes = len(open_store(url, s3_env).read_bytes("manifest.json"))
    assert stats["remote_bytes"] <= 1.01 * m.total_bytes + manifest_bytes, (stats, m.total_bytes)


def test_pickled_columns_are_refused_unless_allowed(tmp_path: Path, cache: NodeCache,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    mds, lit = str(tmp_path / "mds"), str(tmp_path / "lit")
    write_mds(mds, columns={"id": "int", "p": "pkl"}, n=6)
    write_litdata(lit, shape="pickled", n=6)
    for folder in (mds, lit):
        _index(folder, capsys)
        with pytest.raises(datacache.ReaderError) as info:
            _read(folder, cache)
        text = str(info.value)
        assert "\n" not in text and "pickled" in text and "executes" in text and "allow_pickle" in text, text
    ours, _ = _read(mds, cache, reader_options={"allow_pickle": True})
    assert [s["p"] for s in ours] == [s["p"] for s in streaming_reading(mds)]
    ours, _ = _read(lit, cache, reader_options={"allow_pickle": True})
    assert [s["p"] for s in ours] == [s["p"] for s in litdata_reading(lit)]


def test_an_mds_shard_failing_its_index_hash_is_an_integrity_error_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "mds"
    write_mds(str(folder), columns={"id": "int", "b": "bytes"}, n=40, size_limit=200)
    shard = json.loads((folder / "index.json").read_text())["shards"][1]["raw_data"]["basename"]
    data = bytearray((folder / shard).read_bytes())
    data[-1] ^= 0xFF  # same size: only the hash can tell
    (folder / shard).write_bytes(bytes(data))
    err = _index(str(folder), capsys, rc=EXIT_DATA)
    assert shard in err and "index.json" in err and "sha1" in err, err
    assert not (folder / "manifest.json").exists()


@pytest.mark.subprocess
def test_mds_exactly_once_through_the_dataloader_with_2_workers(tmp_path: Path, cache: NodeCache,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(tmp_path / "mds")
    write_mds(folder, columns={"id": "int", "af": "ndarray:int16:2,3", "s": "str"}, n=120, size_limit=1500)
    _index(folder, capsys)
    ds = StreamingDataset(folder, cache=cache, seed=5)
    loader = datacache.DataLoader(ds, batch_size=8, num_workers=2)
    for epoch in range(2):
        ds.set_epoch(epoch)
        ids = [int(i) for batch in loader for i in batch["id"]]
        assert sorted(ids) == list(range(120)) and ids != list(range(120)), f"epoch {epoch}"
    del loader
    ds.close()


# --------------------------------------------------------------------------------------- LitData
# compressed tuples are left out: LitData 0.2.76 cannot read them back (its writer leaves such chunks
# plain, its reader then refuses them for want of the compression's magic)
@pytest.mark.parametrize("compression,level,shape", [(None, None, "dict"), (None, None, "tuple"),
                                                     ("zstd", None, "dict"), ("zstd", "chunk", "dict")])
def test_litdata_items_equal_litdatas_reading(tmp_path: Path, cache: NodeCache, compression: str | None,
                                              level: str | None, shape: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(tmp_path / "lit")
    write_litdata(folder, compression=compression, level=level, shape=shape)
    out = _index(folder, capsys)
    assert out["format"] == "litdata" and out["num_samples"] == 30 and out["num_shards"] == 5
    first = Path(folder, json.loads(Path(folder, "index.json").read_text())["chunks"][0]["filename"]).read_bytes()
    assert first[:8] == b"LDFZ01\0\0" if compression and not level else True, "the framed layout is read"
    assert first[:4] == b"\x28\xb5\x2f\xfd" if level == "chunk" else True, "a whole-file zstd chunk is read"
    ours, _ = _read(folder, cache)
    theirs = litdata_reading(folder)
    assert len(ours) == len(theirs) == 30
    for i, (a, b) in enumerate(zip(ours, theirs)):
        same(a, b, f"item {i}")


def test_litdata_on_s3(tmp_path: Path, cache: NodeCache, s3_env: Any, make_s3_url: Any,
                       capsys: pytest.CaptureFixture[str]) -> None:
    folder, url = str(tmp_path / "lit"), make_s3_url()
    write_litdata(folder, compression="zstd")
    upload(folder, url, s3_env)
    _index(url, capsys)
    ours, _ = _read(url, cache, s3_env)
    for i, (a, b) in enumerate(zip(ours, litdata_reading(folder), strict=True)):
        same(a, b, f"item {i}")


# ---------------------------------------------------------------------------------- Hugging Face
def _plain(v: Any) -> Any:
    """Our value as ``datasets`` gives it by default (Python lists and numbers)."""
    if isinstance(v, (np.ndarray, np.generic)):
        return v.tolist()
    return v


@pytest.mark.parametrize("where", ["local", "s3"])
def test_hf_save_to_disk_rows_equal_datasets_reading(tmp_path: Path, cache: NodeCache, where: str,
                                                     request: pytest.FixtureRequest,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(tmp_path / "hf")
    write_hf(folder)
    url, opts = folder, None
    if where == "s3":
        opts = request.getfixturevalue("s3_env")
        url = request.getfixturevalue("make_s3_url")()
        upload(folder, url, opts)
    out = _index(url, capsys)
    assert out["format"] == "arrow" and out["num_shards"] == 3 and out["num_samples"] == 40
    ours, _ = _read(url, cache, opts)
    theirs = hf_reading(folder)
    assert [{k: _plain(v) for k, v in row.items()} for row in ours] == theirs
    assert ours[0]["vec"].dtype == np.float32 and isinstance(ours[0]["f32"], np.float32)


def test_hf_dataset_dict_names_the_split_to_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import datasets

    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"x": [1, 2]}),
                          "test": datasets.Dataset.from_dict({"x": [3]})}).save_to_disk(str(folder))
    err = _index(str(folder), capsys, rc=EXIT_USAGE)
    assert "DatasetDict" in err and str(folder / "train") in err, err
    assert _index(str(folder / "train"), capsys)["num_samples"] == 2


def test_index_without_format_of_a_plain_folder_says_what_to_do(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.parquet").write_bytes(b"x")
    err = _index(str(tmp_path), capsys, rc=EXIT_USAGE)
    assert "--format" in err and "Streaming" in err, err


def test_a_foreign_dataset_mixes_with_a_datacache_one(tmp_path: Path, cache: NodeCache,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(tmp_path / "mds")
    write_mds(folder, columns={"id": "int", "s": "str"}, n=40, size_limit=400)
    _index(folder, capsys)
    native = str(tmp_path / "native")
    datacache.write_dataset([{"id": 1000 + k, "s": f"n{k}"} for k in range(40)], native, progress=False)
    ds = StreamingDataset(streams=[datacache.Stream(folder, proportion=0.5), datacache.Stream(native, proportion=0.5)],
                          cache=cache, epoch_size=40, seed=1)
    got = [s["id"] for s in ds]
    ds.close()
    assert len(got) == 40 and len(set(got)) == 40
    assert 10 <= sum(i < 1000 for i in got) <= 30


def test_mds_resumes_exactly(tmp_path: Path, cache: NodeCache, capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(tmp_path / "mds")
    write_mds(folder, columns={"id": "int"}, n=60, size_limit=200)
    _index(folder, capsys)
    ds = StreamingDataset(folder, cache=cache, seed=2)
    it = iter(ds)
    first = [next(it)["id"] for _ in range(25)]
    state = ds.state_dict()
    ds.close()
    ds = StreamingDataset(folder, cache=CacheConfig(ram_bytes="4MB", ssd_bytes=0, ram_dir=str(tmp_path / "r2")),
                          seed=2)
    ds.load_state_dict(state)
    rest = [s["id"] for s in ds]
    ds.close()
    assert sorted(first + rest) == list(range(60))


def test_idle_readers_of_compressed_shards_hold_bounded_memory(tmp_path: Path) -> None:
    """The open-reader pool keeps readers across runs; a compressed shard's reader holds its inflated
    copy, so the pool keeps only ``max_held`` bytes of those (the newest reader always)."""
    from datacache.read.open_readers import OpenShards
    from datacache.readers import get_format

    folder = tmp_path / "mds"
    write_mds(str(folder), compression="zstd", columns={"id": "int", "b": "bytes"}, n=40, size_limit=300)
    shards = json.loads((folder / "index.json").read_text())["shards"]
    first = shards[0]
    columns = [list(c) for c in zip(first["column_names"], first["column_encodings"], first["column_sizes"])]
    fmt, options = get_format("mds"), {"columns": columns, "compression": "zstd"}
    budget = 2 * max(s["raw_data"]["bytes"] for s in shards)
    pool, readers = OpenShards(sweep_every=0, max_held=budget), []
    for s in shards:
        path = str(folder / s["zip_data"]["basename"])
        r = pool.checkout(fmt, path, options)
        assert r.get(0)["id"] == sum(x["samples"] for x in shards[:len(readers)])
        pool.checkin(fmt, path, r, options)
        readers.append(r)
    kept = [r for r in readers if not r.closed]
    assert readers[-1] in kept and 1 <= len(kept) < len(readers) and sum(r.held_bytes for r in kept) <= budget
    again = pool.checkout(fmt, readers[0].path, options)  # closed by the budget: opened afresh
    assert again is not readers[0] and again.get(0)["id"] == 0
    pool.close()
